"""The token-level automaton: which tokens may come next in each DFA state, and where they lead.

The DFA (minillm/guided/regex.py) reads bytes; the model emits tokens, each a byte string
(byte-level BPE). A token t is allowed in state s iff walking its bytes from s never reaches
the dead state; it then leads to walk(s, bytes(t)). EOS is allowed iff s is accepting; special
tokens (<|im_start|>, ...) have no bytes and are never allowed.

Per state this is a walk of every token of the vocabulary (49152 for SmolLM2). Done as one
vectorised gather per byte position over all tokens at once (tokens sorted longest first, so
position i only touches the tokens longer than i), it costs a few ms; the resulting mask is
cached per state, lazily, so each state is walked once per (guide, tokenizer) and a decoding
step costs a dictionary lookup plus logits.masked_fill.
"""
from __future__ import annotations

import functools

import torch

from .regex import DFA


@functools.lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte 0..255 is stored in vocab strings as one printable
    character; printable ASCII and Latin-1 stand for themselves, the rest are shifted up to 256+."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, shift = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shift)] = b
            shift += 1
    return chars


def vocabulary_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """The byte string of every token id < vocab_size; b"" for special tokens and unused ids.
    A byte-level BPE tokenizer (minillm's ChatTokenizer) is read from its vocabulary; any other
    tokenizer through decode([id]) (exact only when every token is whole characters)."""
    out = [b""] * vocab_size
    inner = getattr(tokenizer, "tok", None)
    if inner is not None and hasattr(inner, "get_vocab"):
        special = set(inner.get_added_tokens_decoder())
        decoder = _byte_decoder()
        for piece, i in inner.get_vocab(with_added_tokens=True).items():
            if i < vocab_size and i not in special:
                out[i] = bytes(decoder[c] for c in piece)
        return out
    for i in range(vocab_size):
        if i != tokenizer.eos_token_id:
            out[i] = tokenizer.decode([i], skip_special_tokens=True).encode()
    return out


class TokenVocabulary:
    """A tokenizer's tokens as bytes, laid out for the vectorised walk; built once per tokenizer."""

    def __init__(self, token_bytes: list[bytes], eos_token_id: int | None):
        self.token_bytes = token_bytes
        self.eos_token_id = eos_token_id
        lengths = torch.tensor([len(b) for b in token_bytes])                    # (V,)
        self.order = torch.argsort(lengths, descending=True, stable=True)        # (V,) longest first
        longest = max(int(lengths.max()), 1)
        packed = b"".join(token_bytes[i].ljust(longest, b"\0") for i in self.order.tolist())
        self.sorted_bytes = torch.frombuffer(bytearray(packed), dtype=torch.uint8).view(-1, longest)  # (V, L)
        # active[i]: how many tokens (a prefix of the sorted order) have more than i bytes
        at_most = torch.bincount(lengths, minlength=longest + 1).cumsum(0)     # (L+1,) tokens with <= i bytes
        self.active = (len(token_bytes) - at_most[:longest]).tolist()


class TokenAutomaton:
    """A DFA lifted to tokens: mask(state) -> bool (V,) of allowed tokens; next_state(state, token)."""

    def __init__(self, dfa: DFA, vocab: TokenVocabulary):
        self.dfa = dfa
        self.vocab = vocab
        self.table = torch.tensor(dfa.transitions, dtype=torch.long)           # (S, 256)
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, state: int) -> torch.Tensor:
        """bool (V,): the tokens allowed in `state` (computed once, then cached)."""
        m = self._masks.get(state)
        if m is None:
            v = self.vocab
            m = allowed_tokens(self.table, self.dfa.dead, state, v.sorted_bytes, v.active, v.order)
            if v.eos_token_id is not None and v.eos_token_id < len(m):
                m[v.eos_token_id] = self.dfa.accepting[state]
            if not m.any() and state != self.dfa.dead:     # byte-level BPE spells anything; a smaller vocabulary may not
                raise ValueError(f"guided decoding: no token of the vocabulary continues the grammar from DFA "
                                 f"state {state}; the constraint needs characters this tokenizer cannot produce")
            self._masks[state] = m
        return m

    def next_state(self, state: int, token: int) -> int:
        if token == self.vocab.eos_token_id:
            return state
        return self.dfa.walk(state, self.vocab.token_bytes[token])

    @property
    def start(self) -> int:
        return self.dfa.start

    @property
    def dead(self) -> int:
        return self.dfa.dead

    def is_accepting(self, state: int) -> bool:
        return self.dfa.accepting[state]

    def step(self, state: int, byte: int) -> int:
        return self.dfa.transitions[state][byte]

    def live_bytes(self, state: int) -> list[int]:
        return [b for b, t in enumerate(self.dfa.transitions[state][:256]) if t != self.dfa.dead]

    @property
    def num_cached_states(self) -> int:
        return len(self._masks)


def allowed_tokens(table: torch.Tensor, dead: int, state: int, sorted_bytes: torch.Tensor,
                   active: list[int], order: torch.Tensor) -> torch.Tensor:
    """bool (V,): which tokens can be read from `state` without reaching the dead state.

    table (S, 256) long: the DFA's transitions; sorted_bytes (V, L) uint8: the tokens' bytes, longest
    token first, zero-padded; active[i]: how many of those tokens have more than i bytes;
    order (V,): sorted row -> token id. Tokens with no bytes (special ones) are never allowed."""
    # BEGIN SOLUTION token_mask
    rows = torch.arange(active[0] if active else 0)                              # (R,) live sorted rows
    cur = torch.full((len(rows),), state, dtype=torch.long)                      # (R,) their DFA state
    for i, n in enumerate(active):
        k = int(torch.searchsorted(rows, n))              # rows[:k] have a byte at position i
        if k == 0:
            break
        cur[:k] = table[cur[:k], sorted_bytes[rows[:k], i].long()]             # (k,) one byte further
        live = cur != dead                                                       # (R,)
        rows, cur = rows[live], cur[live]
    out = torch.zeros(sorted_bytes.shape[0], dtype=torch.bool)                   # (V,) by token id
    out[order[rows]] = True
    return out
    # END SOLUTION
