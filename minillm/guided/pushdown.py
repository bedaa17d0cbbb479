"""The pushdown automaton of a grammar (grammar.py), walked a byte at a time and lifted to tokens.

A stack is a chain of frames (rule, DFA state), the top one being where the input is now; each
frame below it is where its caller resumes. Reading a byte moves the top frame along its rule's
DFA; a call pushes the callee's start; reaching an accepting state may pop (the caller resumes).
Because a byte can be read more than one way (pop or stay, this alternative or that call), the
parser keeps a SET of stacks (a configuration), like llama.cpp's GBNF sampler. Frames are interned
as nodes (rule, state, parent node), so a stack is one int and stacks share their tails.

Configurations are interned too, and a configuration's step on each byte is computed once and
remembered: the automaton is built lazily, as a DFA over the configurations the documents
actually visit. A token is allowed in a configuration iff walking its bytes never reaches the
empty configuration; the walk over the whole vocabulary is the same vectorised gather as for a
regex (token_automaton.allowed_tokens), the table growing where the walk finds a gap.

The mask cache (xgrammar's adaptive token mask cache): what a token does while it stays inside
the top frame's rule (and the rules it calls) does not depend on the stack below. So per frame
(rule, state), walked once with an unknown caller, each token is
    accepted     consumed without leaving the frame (or leaving it exactly at its last byte),
    rejected     dies inside the frame,
    uncertain    leaves the frame with bytes left over, which the caller must read.
A configuration's mask is then the union of its top frames' accepted sets, plus those uncertain
tokens that the real stacks accept (walked with the real stacks: usually a handful, not the
vocabulary). The bottom frame's caller is known (the end of the document), so it has none.
Masks are also cached per configuration (least recently used dropped). grammar.py inlines the
rules that are not recursive, which is what keeps calls, and so uncertain tokens, rare.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from .grammar import Grammar
from .token_automaton import TokenVocabulary

ROOT = -1            # the parent of a document's bottom frame: popping it completes the document
LOCAL = -2           # the parent in a probe of one frame: popping it leaves the frame
DEAD = 0             # the empty configuration (no stack can go on)
DONE, LEFT = 1, 2    # flags of a configuration: the bottom frame was popped just now / earlier
MASKS_CACHED = 512   # per-configuration masks kept per automaton
WALK_ONE_BY_ONE = 256  # fewer uncertain tokens than this: walk each in Python, not the vectorised gather


class PushdownAutomaton:
    """A grammar lifted to tokens: mask(config) -> bool (V,), next_state(config, token)."""

    def __init__(self, grammar: Grammar, vocab: TokenVocabulary):
        self.grammar, self.vocab = grammar, vocab
        rules = grammar.rules
        self.trans = [r.dfa.transitions for r in rules]
        self.dead_state = [r.dfa.dead for r in rules]
        self.accepting = [r.dfa.accepting for r in rules]
        self.rule_start = [r.dfa.start for r in rules]
        self.has_bytes = [[any(t != r.dfa.dead for t in row[:256]) for row in r.dfa.transitions] for r in rules]
        self.calls = [[r.calls(s) for s in range(r.dfa.num_states)] for r in rules]
        # a state that can only pop: a call resuming there needs no frame of its own (a tail call)
        self.final = [[r.dfa.accepting[s] and not self.has_bytes[i][s] and not self.calls[i][s]
                       for s in range(r.dfa.num_states)] for i, r in enumerate(rules)]
        self.node_ids: dict[tuple[int, int, int], int] = {}
        self.nodes: list[tuple[int, int, int]] = []
        self._closures: dict[int, tuple[frozenset, bool]] = {}
        self.config_ids: dict[tuple, int] = {}
        self.configs: list[tuple[bool, frozenset, int]] = [(False, frozenset(), 0)]   # (local, stacks, flags); DEAD
        self.table = torch.full((64, 256), -1, dtype=torch.long)     # (C, 256) next config, -1 not yet known
        self._steps: dict[int, int] = {}                              # config * 256 + byte -> config
        self.frame_masks: dict[tuple[int, int, bool], tuple[torch.Tensor, list[int], bool]] = {}
        self._masks: OrderedDict[int, torch.Tensor] = OrderedDict()
        self.rank = torch.argsort(vocab.order)                              # (V,) token id -> sorted row
        stacks, done = self._closure(self._node(0, self.rule_start[0], ROOT))
        self.start = self._config(False, stacks, DONE if done else 0)
        self.dead = DEAD

    # ---- stacks and configurations ----

    def _node(self, rule: int, state: int, parent: int) -> int:
        key = (rule, state, parent)
        i = self.node_ids.get(key)
        if i is None:
            i = self.node_ids[key] = len(self.nodes)
            self.nodes.append(key)
        return i

    def _closure(self, node: int) -> tuple[frozenset, bool]:
        """Every stack reachable from `node` without reading a byte (calls pushed, finished rules
        popped), keeping those whose top can read a byte; and whether the bottom frame popped."""
        hit = self._closures.get(node)
        if hit is not None:
            return hit
        out, popped, seen, todo = set(), False, {node}, [node]
        while todo:
            n = todo.pop()
            r, q, parent = self.nodes[n]
            if self.has_bytes[r][q]:
                out.add(n)
            for callee, resume in self.calls[r][q]:
                below = parent if self.final[r][resume] else self._node(r, resume, parent)
                child = self._node(callee, self.rule_start[callee], below)
                if child not in seen:
                    seen.add(child)
                    todo.append(child)
            if self.accepting[r][q]:
                if parent < 0:
                    popped = True
                elif parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        hit = self._closures[node] = (frozenset(out), popped)
        return hit

    def _config(self, local: bool, stacks: frozenset, flags: int) -> int:
        if not stacks and not flags:
            return DEAD
        key = (local, stacks, flags)
        i = self.config_ids.get(key)
        if i is None:
            i = self.config_ids[key] = len(self.configs)
            self.configs.append(key)
        return i

    def step(self, config: int, byte: int) -> int:
        """The configuration after reading one byte (DEAD if no stack can read it)."""
        key = config * 256 + byte
        nxt = self._steps.get(key)
        if nxt is None:
            local, stacks, flags = self.configs[config]
            out, popped = set(), False
            for n in stacks:
                r, q, parent = self.nodes[n]
                t = self.trans[r][q][byte]
                if t != self.dead_state[r]:
                    more, done = self._closure(self._node(r, t, parent))
                    out |= more
                    popped |= done
            # a local probe that already left its frame has bytes left over: the caller decides
            flags = (DONE if popped else 0) | (LEFT if local and flags else 0)
            nxt = self._steps[key] = self._config(local, frozenset(out), flags)
        return nxt

    # ---- tokens ----

    def walk(self, config: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Walk the tokens at sorted `rows` (ascending) from `config` -> (surviving rows, their configs)."""
        v = self.vocab
        cur = torch.full((len(rows),), config, dtype=torch.long)                # (R,)
        for i, n in enumerate(v.active):
            k = int(torch.searchsorted(rows, n))              # rows[:k] have a byte at position i
            if k == 0:
                break
            cur[:k] = self._gather(cur[:k], v.sorted_bytes[rows[:k], i].long())  # (k,)
            live = cur != DEAD
            rows, cur = rows[live], cur[live]
        return rows, cur

    def _gather(self, configs: torch.Tensor, data: torch.Tensor) -> torch.Tensor:
        """table[configs, data], filling the entries not computed yet."""
        if len(self.configs) > self.table.shape[0]:
            self._grow()
        nxt = self.table[configs, data]
        gaps = nxt < 0
        if gaps.any():
            for key in torch.unique(configs[gaps] * 256 + data[gaps]).tolist():
                c, b = divmod(key, 256)
                t = self.step(c, b)
                if len(self.configs) > self.table.shape[0]:
                    self._grow()
                self.table[c, b] = t
            nxt = self.table[configs, data]
        return nxt

    def _grow(self):
        more = torch.full((max(len(self.configs), 2 * self.table.shape[0]) - self.table.shape[0], 256), -1,
                          dtype=torch.long)
        self.table = torch.cat([self.table, more])

    def frame_mask(self, node: int) -> tuple[torch.Tensor, list[int], bool]:
        """The stack-independent part for a top frame: (accepted bool (V,) by token id, uncertain
        token ids, whether any token is accepted), from one walk of the vocabulary with an unknown
        caller; cached per (rule, state, bottom). A bottom frame's caller is known (the end of the
        document), so it has no uncertain tokens."""
        rule, state, parent = self.nodes[node]
        key = (rule, state, parent == ROOT)
        hit = self.frame_masks.get(key)
        if hit is None:
            bottom = parent == ROOT
            stacks, popped = self._closure(self._node(rule, state, ROOT if bottom else LOCAL))
            probe = self._config(not bottom, stacks, DONE if popped else 0)
            v = self.vocab
            rows, ends = self.walk(probe, torch.arange(v.active[0] if v.active else 0))
            kinds, which = torch.unique(ends, return_inverse=True)
            ok = torch.tensor([bool(self.configs[c][1]) or bool(self.configs[c][2] & DONE) for c in kinds.tolist()],
                              dtype=torch.bool)
            accepted = ok[which]                                                # (R,)
            mask = torch.zeros(len(v.token_bytes), dtype=torch.bool)
            mask[v.order[rows[accepted]]] = True
            uncertain = sorted(v.order[rows[~accepted]].tolist())
            hit = self.frame_masks[key] = (mask, uncertain, bool(accepted.any()))
        return hit

    def mask(self, config: int) -> torch.Tensor:
        """bool (V,): the tokens allowed in `config` (EOS iff the document may end here)."""
        m = self._masks.get(config)
        if m is not None:
            self._masks.move_to_end(config)
            return m
        _, stacks, flags = self.configs[config]
        frames = [self.frame_mask(n) for n in stacks]
        m = frames[0][0].clone() if frames else torch.zeros(len(self.vocab.token_bytes), dtype=torch.bool)
        for accepted, _, _ in frames[1:]:
            m |= accepted
        uncertain = sorted(set().union(*(u for _, u, _ in frames))) if len(frames) > 1 else \
            (frames[0][1] if frames else [])
        if len(uncertain) <= WALK_ONE_BY_ONE:                                    # walked on the real stacks
            allowed = [t for t in uncertain if self.next_state(config, t) != DEAD]
        else:
            rows, _ = self.walk(config, torch.sort(self.rank[uncertain]).values)
            allowed = self.vocab.order[rows].tolist()
        if allowed:
            m[allowed] = True
        eos = self.vocab.eos_token_id
        if flags & DONE and eos is not None and eos < len(m):       # EOS has no bytes: False in every frame mask
            m[eos] = True
        if not (allowed or flags & DONE or any(f[2] for f in frames)) and config != DEAD:
            raise ValueError("guided decoding: no token of the vocabulary continues the grammar here; the "
                             "constraint needs characters this tokenizer cannot produce")
        self._masks[config] = m
        if len(self._masks) > MASKS_CACHED:
            self._masks.popitem(last=False)
        return m

    def clear_mask_cache(self) -> None:
        """Forget the per-configuration masks (the frame masks stay): what a step costs without them."""
        self._masks.clear()

    def precompute(self) -> None:
        """Every frame's mask now rather than on first use (what xgrammar does at compile time)."""
        some_caller = self._node(0, self.rule_start[0], ROOT)
        called = {r for rule in self.grammar.rules for r in rule.callees}
        for rule, dfa_rows in enumerate(self.trans):
            for state in range(len(dfa_rows)):
                if self.has_bytes[rule][state]:
                    if rule in called:                   # under a caller
                        self.frame_mask(self._node(rule, state, some_caller))
                    self.frame_mask(self._node(rule, state, ROOT))       # at the bottom (tail calls too)

    def next_state(self, config: int, token: int) -> int:
        if token == self.vocab.eos_token_id:
            return config
        for b in self.vocab.token_bytes[token]:
            config = self.step(config, b)
        return config

    def is_accepting(self, config: int) -> bool:
        return bool(self.configs[config][2] & DONE)

    def live_bytes(self, config: int) -> list[int]:
        return [b for b in range(256) if self.step(config, b) != DEAD]

    def stats(self) -> dict:
        uncertain = [len(ids) for _, ids, _ in self.frame_masks.values()]
        return {"frames_cached": len(self.frame_masks), "configurations": len(self.configs),
                "stack_nodes": len(self.nodes),
                "uncertain_tokens_mean": sum(uncertain) / max(len(uncertain), 1)}
