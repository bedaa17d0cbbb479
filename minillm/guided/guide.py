"""A guide: GuidedDecodingParams -> an automaton over tokens, and the per-request state.

    guide = compile_guide(params.guided_decoding, tokenizer, vocab_size)   # cached
    state = GuideState(guide)
    logits = state.masked(logits)      # (V,) disallowed tokens at -inf
    state.advance(token)
    state.forced_tokens()              # jump-forward: tokens the grammar leaves no choice about

Two automata, one interface (start, mask, next_state, is_accepting, live_bytes):
    regex=..., choice=[...]            -> regex.py's DFA, lifted to tokens (token_automaton.py)
    json=schema, json_object=True,     -> a grammar (json_schema.py writes one for a schema),
    grammar="root ::= ..."                its pushdown automaton lifted to tokens (pushdown.py)
A regex is the simpler tool where it is enough; JSON nests, so a schema needs the stack.

Jump-forward (SGLang's compressed FSM): when the automaton has exactly one way forward (one
live byte and not accepting), follow it to collect the forced bytes, e.g. '", "age": ' after a
string value. We encode those bytes with the tokenizer and append the tokens without running
the model for them. The retokenisation boundary: BPE would tokenise the forced text together
with what the model writes next (e.g. ': "' + 'Ada' might have been ': "Ada' ...), so the last
forced token is held back and left to the model, which can then pick a merge across the
boundary; the tokens before it cannot be affected by what follows. On the other side, the
forced text is not merged with the tokens already generated (that would mean rewriting the
KV cache): the sequence may hold a split that plain BPE would have merged, which the model
reads fine in practice. The forced tokens are checked against the automaton before being used.
"""
from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import torch

from .grammar import Grammar
from .json_schema import any_object_grammar, schema_to_grammar
from .pushdown import PushdownAutomaton
from .regex import compile_regex, escape
from .token_automaton import TokenAutomaton, TokenVocabulary, vocabulary_bytes

MAX_FORCED_BYTES = 256          # one jump-forward appends at most this much text
GUIDES_PER_TOKENIZER = 64       # compiled guides kept per tokenizer (least recently used dropped)


def guide_source(guided) -> tuple[str, str]:
    """GuidedDecodingParams -> ("regex", pattern) or ("grammar", EBNF text) (ValueError for a bad one)."""
    if guided.regex is not None:
        return "regex", guided.regex
    if guided.choice is not None:
        return "regex", "(?:" + "|".join(escape(c) for c in guided.choice) + ")"
    if guided.grammar is not None:
        return "grammar", guided.grammar
    if guided.json is not None:
        return "grammar", schema_to_grammar(guided.json)
    return "grammar", any_object_grammar()


class Guide:
    """One compiled constraint for one tokenizer: its automaton over tokens."""

    def __init__(self, kind: str, source: str, vocab: TokenVocabulary, tokenizer):
        self.kind, self.source, self.tokenizer = kind, source, tokenizer
        if kind == "regex":
            dfa = compile_regex(source)
            if dfa.accepting == [False] * dfa.num_states:
                raise ValueError(f"guided decoding: the pattern {source[:80]!r} matches no string at all")
            self.automaton = TokenAutomaton(dfa, vocab)
        else:
            self.automaton = PushdownAutomaton(Grammar(source), vocab)


_vocabularies: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # tokenizer -> {V: TokenVocabulary}
_guides: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()         # tokenizer -> OrderedDict
_lock = threading.Lock()        # the server validates in its HTTP threads while the engine thread runs


def compile_guide(guided, tokenizer, vocab_size: int) -> Guide:
    """The Guide for (constraint, tokenizer), compiled once and cached (ValueError if it is bad)."""
    kind, source = guide_source(guided)
    with _lock:
        cache = _guides.setdefault(tokenizer, OrderedDict())
        key = (kind, source, vocab_size)
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        vocabs = _vocabularies.setdefault(tokenizer, {})
        if vocab_size not in vocabs:
            eos = getattr(tokenizer, "eos_token_id", None)
            vocabs[vocab_size] = TokenVocabulary(vocabulary_bytes(tokenizer, vocab_size), eos)
        guide = Guide(kind, source, vocabs[vocab_size], tokenizer)
        cache[key] = guide
        if len(cache) > GUIDES_PER_TOKENIZER:
            cache.popitem(last=False)
        return guide


class GuideState:
    """Where one request is in its guide's automaton."""

    def __init__(self, guide: Guide, jump_forward: bool = False):
        self.guide = guide
        self.automaton = guide.automaton
        self.state = self.automaton.start
        self.jump_forward = jump_forward
        self.num_forced_tokens = 0          # tokens appended by jump-forward (not sampled)

    @property
    def accepting(self) -> bool:
        return self.automaton.is_accepting(self.state)

    def masked(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (V,) -> (V,) with every token the grammar forbids at -inf."""
        allowed = self.automaton.mask(self.state).to(logits.device)      # (V,)
        return logits.masked_fill(~allowed, float("-inf"))

    def advance(self, token: int) -> None:
        nxt = self.automaton.next_state(self.state, token)
        if nxt == self.automaton.dead:
            raise RuntimeError(f"guided decoding: token {token} is not allowed in state {self.state}")
        self.state = nxt

    def forced_bytes(self) -> bytes:
        """The bytes the automaton admits as the only continuation from here (b"" if there is a choice)."""
        automaton, state, out = self.automaton, self.state, bytearray()
        while not automaton.is_accepting(state) and len(out) < MAX_FORCED_BYTES:
            live = automaton.live_bytes(state)
            if len(live) != 1:
                break
            out.append(live[0])
            state = automaton.step(state, live[0])
        return bytes(out)

    def forced_tokens(self) -> list[int]:
        """Jump-forward: tokens for the forced text, minus the last one (the retokenisation
        boundary, see the module docstring). Empty when nothing is forced."""
        text = self.forced_bytes().decode("utf-8", errors="ignore")       # whole characters only
        if not text:
            return []
        tok = self.guide.tokenizer
        ids = tok.encode(text)
        if getattr(tok, "add_bos", False) and ids and ids[0] == tok.bos_token_id:
            ids = ids[1:]
        ids = ids[:-1]
        automaton, state = self.automaton, self.state
        for t in ids:                                   # the tokens must spell a prefix of the forced text
            state = automaton.next_state(state, t)
            if state == automaton.dead:
                return []
        return ids


def check_jump_forward(tokenizer) -> None:
    if not hasattr(tokenizer, "encode"):
        raise ValueError("guided_decoding.jump_forward needs a tokenizer with encode() (to tokenise the forced "
                         "text); this one has none: use jump_forward=False")
