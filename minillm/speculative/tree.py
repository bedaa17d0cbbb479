"""Tree drafts: several candidates per position, one verification, the target's distribution kept.

A chain of k drafts dies at its first rejection. A tree offers the target several candidates at
each position (SpecInfer, Medusa, EAGLE-2): if the first guess for position 1 is wrong, the
second may be right, and the path continues under it.

    pending token ─┬─ " the" ─┬─ " cat"        nodes in topological order, each with its parent
                   │          └─ " dog"        (-1: the pending token) and, for a sampled draft,
                   └─ " a" ──── " cat"         the distribution q it was drawn from

The target scores every node once (row 0: after the pending token; row 1 + i: after node i and its
ancestors; in an engine, one forward with a tree attention mask). Then, from the root down:

    greedy     take the child whose token is the target's argmax, if any; else emit the argmax
    sampling   multi-candidate rejection sampling over the children, in order, with the current
               distribution p (starting from the target's row):
                 a deterministic candidate c (q one-hot):  accept with probability p(c), else
                     p <- p with c removed, renormalised
                 a sampled candidate c ~ q:  accept with min(1, p(c) / q(c)), else
                     p <- norm(max(0, p - q))   (SpecInfer's rule; the children of one node are
                     drawn independently from the same q)
               none accepted: emit a token drawn from the final p, and stop

Why it is exact (deterministic candidates): P(emit c1) = p(c1); P(emit c2) = (1 - p(c1)) *
p(c2) / (1 - p(c1)) = p(c2); and so on: a sequential test of the candidates is one draw from p.
For sampled ones each step is the chain rule of lesson 08, applied to the residual left by the
previous rejection. tests/speculative/test_tree.py checks both with the project's chi-square test.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass, field

import torch

from minillm.engine.sampling import SamplingParams, filtered_probs


@dataclass
class DraftTree:
    """Nodes in topological order: tokens[i] hangs under parents[i] (-1: the pending token). q[i],
    if given, is the distribution (V,) tokens[i] was sampled from; None: a deterministic guess."""
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list[torch.Tensor | None] = field(default_factory=list)

    def add(self, token: int, parent: int = -1, q: torch.Tensor | None = None) -> int:
        if not -1 <= parent < len(self.tokens):
            raise ValueError(f"DraftTree.add: parent {parent} is not a node yet (nodes 0..{len(self.tokens) - 1}, "
                             f"or -1 for the pending token)")
        self.tokens.append(token)
        self.parents.append(parent)
        self.q.append(q)
        return len(self.tokens) - 1

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestors(self) -> torch.Tensor:
        """bool (n, n): row i is True on node i and every ancestor of it: the tree attention mask
        among the drafts (each also sees the whole context)."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def depths(self) -> list[int]:
        """Each node's distance from the pending token (its position offset in the sequence)."""
        out = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out


def tree_paths(spec, max_nodes: int) -> tuple[tuple[int, ...], ...]:
    """NEW: the engine's static draft tree (vLLM's speculative_token_tree): a list of paths of child ranks, or its
    string. (0,) is the draft's first choice after the pending token, (1,) its second, (0, 0) the first choice
    after (0,), ... Every path's parent must be listed too. -> the paths in topological order (by depth, then
    rank): the order of the tree's nodes in a step."""
    if isinstance(spec, str):
        try:
            spec = ast.literal_eval(spec)
        except (ValueError, SyntaxError):
            raise ValueError(f"speculative_token_tree = {spec!r} is not a list of tuples of child ranks, e.g. "
                             f"[(0,), (1,), (0, 0)]") from None
    if not isinstance(spec, (list, tuple)) or not spec:
        raise ValueError(f"speculative_token_tree = {spec!r}: allowed: a non-empty list of tuples of child ranks, "
                         f"e.g. [(0,), (1,), (0, 0)]")
    paths = []
    for path in spec:
        if (not isinstance(path, (list, tuple)) or not path
                or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path)):
            raise ValueError(f"speculative_token_tree: {path!r} is not a path; allowed: a non-empty tuple of child "
                             f"ranks >= 0, e.g. (0, 1)")
        paths.append(tuple(path))
    if len(set(paths)) != len(paths):
        raise ValueError(f"speculative_token_tree lists a path twice: {spec!r}")
    missing = [p for p in paths if len(p) > 1 and p[:-1] not in set(paths)]
    if missing:
        raise ValueError(f"speculative_token_tree: the parent of {missing[0]} ({missing[0][:-1]}) is not listed; "
                         f"every path's parent must be")
    if len(paths) > max_nodes:
        raise ValueError(f"speculative_token_tree has {len(paths)} nodes; allowed: at most {max_nodes} (the pending "
                         f"token and the tree are verified as one small step of at most {max_nodes + 1} rows)")
    return tuple(sorted(paths, key=lambda p: (len(p), p)))


def verify_tree(tree: DraftTree, logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None = None) -> tuple[list[int], list[int]]:
    """logits (1 + n, V): row 0 after the pending token, row 1 + i after node i. Returns the tokens
    to emit (the accepted path's tokens, then one of the target's own) and the accepted nodes."""
    tokens, path, node = [], [], -1
    while True:
        row = logits[node + 1]                                                # (V,)
        children = tree.children(node)
        if params.greedy:
            choice = int(row.argmax())
            hit = next((c for c in children if tree.tokens[c] == choice), None)
        else:
            hit, choice = _sample_children(tree, children, filtered_probs(row, params), generator)
        if hit is None:
            return tokens + [choice], path
        tokens.append(tree.tokens[hit])
        path.append(hit)
        node = hit


def _sample_children(tree: DraftTree, children: list[int], p: torch.Tensor, generator) -> tuple[int | None, int]:
    """Multi-candidate rejection sampling: (the accepted child or None, the emitted token). A
    node's children are either all deterministic or all drawn independently from the same q."""
    target = p
    for c in children:
        token, q = tree.tokens[c], tree.q[c]
        u = float(torch.rand((), generator=generator))
        if q is None:                                                         # one-hot guess
            if u < float(p[token]):
                return c, token
            p = p.clone()
            p[token] = 0
        else:
            if u * float(q[token]) < float(p[token]):
                return c, token
            p = (p - q.to(p.dtype)).clamp(min=0)
        mass = p.sum()
        if mass <= 0:             # nothing left, which only rounding can cause: the target's row decides
            p = target
            break
        p = p / mass
    return None, int(torch.multinomial(p, 1, generator=generator))
