"""Speculative decoding inside continuous batching: drafts ride in the engine's own step.

Lesson 08's teaching loop (minillm/stages/speculative_loop.py) runs one request at a time beside the engine,
with the rules and drafts of minillm/speculative/core.py, which this file shares. Servers (vLLM v1, SGLang)
speculate inside the batch instead, and the engine's one idea carries it: a request's
num_computed_tokens may catch up by more than one token per step.

    1. propose    before scheduling, every running request that is decoding gets up to k_i draft
                  tokens (req.spec_token_ids) from its own proposer; the policy below picks k_i
    2. schedule   its pending token and the drafts run as ONE run of 1 + k_i tokens, in the same
                  flat forward as the other requests' decodes and prefill chunks (scheduler.py)
    3. verify     the 1 + k_i rows of logits decide how many drafts the target accepts: greedy
                  verification or the rejection sampler (speculative.py), so the output is
                  exactly the target's; the a accepted drafts and one token of the target's own
                  are appended: 1 + a tokens for one row of the batch
    4. roll back  num_computed_tokens goes to n + a; BlockManager.truncate forgets the rejected
                  drafts' slots and returns every block the rollback left empty

Tree drafts (NEW; EAGLE with speculative_token_tree): a lone request's drafts may be a static tree of
child ranks (tree.py), scheduled as one run whose rows follow their parents (build_batch's run tree:
each row at its depth's position, attending to its ancestors) and verified by one small step with
verify_tree; the accepted path's K/V then moves to the slots right after the pending token
(PagedKVCache.move_slots), where a chain's already is, and the rest rolls back as above.

When does it pay? A step over N tokens costs t(N). Decode at small N is bound by reading the
weights, so t grows slowly with N and drafts are almost free; at large N the step is bound by
compute, t grows ~linearly, and every rejected draft is paid for in full. The policy fits
t(N) = a + b N to the engine's own recent steps (StepCostModel) and adds drafts one at a time,
best first, while they raise the step's expected throughput E / t:

    the j-th draft of request i is accepted with probability alpha_i^j (all before it must be);
    it adds alpha_i^j tokens and b (+ the draft's own cost c) seconds, so it pays when
        alpha_i^j / (b + c)  >  E / t        (marginal yield beats the step's average)

At batch 1 E / t is ~1 / a and b << a: almost any draft pays. At batch 64 E / t is ~64 / (a + 64 b)
and only drafts with alpha^j above ~ b / (a / 64 + b) pass: speculation fades out where the step turns
compute-bound. vLLM v0 had a fixed threshold instead (speculative_disable_by_batch_size).
"""
from __future__ import annotations

import time

import torch

from .core import (DraftPool, ModelDraft, NgramDraft, StepCostModel, draft_model, estimate_alpha,
                   plan_draft_lengths, verify)
from .eagle import EagleDraft, load_head
from .tree import DraftTree, verify_tree


class EngineSpeculation:
    """The engine's speculative decoding: proposers, the policy, verification, statistics. A draft model
    ("draft", "layerskip") runs on one DraftPool (speculative.py: the production ModelRunner over a paged
    cache of its own), built with the engine and shared by its requests, each a ModelDraft holding its
    own blocks; a request that finished gives them back when the next step proposes."""

    def __init__(self, llm, config):
        """config: a config.SpeculativeConfig with a method (validated there)."""
        if config.method is None:
            raise ValueError("EngineSpeculation needs a SpeculativeConfig with a method; got method=None")
        self.llm, self.method, self.k, self.policy = llm, config.method, config.num_speculative_tokens, config.policy
        self.tree = config.token_tree           # NEW: tree drafts: the static tree's paths, or None (chains)
        self.cost = StepCostModel()
        self.ngram = NgramDraft() if self.method == "ngram" else None
        # NEW: EAGLE, a head on the target's features (eagle.py), each request its own small cache of the head
        self.head = load_head(llm.model, config.model) if self.method == "eagle" else None
        if self.head is not None and llm.model.embed.weight.device.type == "cpu":
            self.head.use_blocked_linears()
        # A draft model ("draft", "layerskip") runs through the production forward: one DraftPool (a
        # ModelRunner over a paged cache of its own) shared by every request, each holding its own blocks.
        self.pool = None if self.method in ("ngram", "eagle") else DraftPool(
            draft_model(llm.model, self.method), llm.max_model_len + self.k + 1,
            attention_backend=llm.attention_backend)
        self.drafting: list = []                # requests whose ModelDraft holds blocks of the pool
        self.drafted = self.accepted = self.rejections = self.verify_runs = self.tree_verifications = 0
        self.draft_seconds = 0.0

    # --- 1. propose --------------------------------------------------------------------------
    def propose(self, running: list, max_num_batched_tokens: int, tree_rows: int = 0) -> None:
        """Give each decoding request (its pending token is its only uncomputed one; not one that
        jumps forward, whose forced runs would land between the drafts) its drafts for the next
        step, as many as the policy allows. A guided request's drafts end at the first one its
        grammar forbids (guided_drafts). With a token tree, a lone request's drafts are the tree
        where the step can verify it (tree_rows: the runner's most rows for a tree step); otherwise a
        chain as deep as the tree."""
        self._release_finished()
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1
                    and (r.guide is None or not r.guide.jump_forward)]
        for r in running:
            r.spec_token_ids, r.spec_probs, r.spec_parents = [], None, None
        if not decoding:
            return
        room = [self._room(r) for r in decoding]
        base_tokens = min(max_num_batched_tokens, sum(r.num_tokens - r.num_computed_tokens for r in running))
        ks = room
        if self.policy == "adaptive":
            spent = self.draft_seconds / self.drafted if self.drafted and self.method != "ngram" else 0.0
            ks = plan_draft_lengths([self.alpha(r) for r in decoding], room, base_tokens, len(decoding),
                                    self.cost.fit(), spent)
        t0 = time.perf_counter()
        lone = len(decoding) == 1 and base_tokens == 1
        for r, k in zip(decoding, ks):
            paths = self._tree_for(r, tree_rows) if k > 0 and lone else None
            if paths:                                                          # NEW: tree drafts
                r.spec_token_ids, r.spec_parents = self._drafter(r).propose_tree(r.all_token_ids, paths)
                r.spec_parents = r.spec_parents or None
            elif k > 0:
                k = k if self.tree is None else min(k, len(self.tree[-1]))    # a chain as deep as the tree
                tokens, q = self._drafter(r).propose(r.all_token_ids, k, r.params, r.generator)
                if r.guide is not None:
                    tokens, q = guided_drafts(r.guide, list(tokens), q)
                r.spec_token_ids, r.spec_probs = list(tokens), q
        self.draft_seconds += time.perf_counter() - t0

    def _tree_for(self, r, tree_rows: int) -> tuple | None:
        """The tree for this request: the configured one cut to the depth of its room (a prefix-closed cut is
        a tree), where the step can verify it and its nodes' slots fit (they follow the pending token); None
        for a guided request (its grammar masks a chain) or without a tree."""
        if self.tree is None or r.guide is not None or 1 + len(self.tree) > tree_rows:
            return None
        room = self._room(r)
        paths = tuple(p for p in self.tree if len(p) <= room)
        return paths if len(paths) <= self.llm.max_model_len - r.num_tokens else None

    def _room(self, r) -> int:
        """Drafts that can still become output: one token of the target's own always follows them."""
        left = min(r.params.max_tokens - len(r.output_token_ids), self.llm.max_model_len - r.num_tokens)
        return max(0, min(self.k, left - 1))

    def _drafter(self, r):
        if self.ngram is not None:
            return self.ngram
        if self.head is not None:
            if r.drafter is None:
                r.drafter = EagleDraft(self.head)
            return r.drafter
        if r.drafter is None:
            r.drafter = ModelDraft(self.pool.model, self.pool)
            room = min(self.llm.max_model_len, len(r.prompt_token_ids) + r.params.max_tokens) + self.k + 1
            r.drafter.reset(room)
            self.drafting.append(r)
        return r.drafter

    def wants_features(self, requests: list) -> list[bool] | None:
        """Which of the step's runs return their top-layer features (build_batch): all, for an EAGLE head."""
        return None if self.head is None else [True] * len(requests)

    def take_features(self, plan, runs: list[tuple[int, int]], features: torch.Tensor, kept: dict) -> None:
        """After verification: each request's EAGLE drafter gets the features (F, dim) of its run's positions
        (runs: (start, length) as scheduled) that stand: plan.num_new_tokens, after verification, ends a
        run at its last accepted draft; kept[id(req)], for a verified run, names its rows that stand (a
        tree's accepted path)."""
        row = 0
        for req, (start, n_run), n_valid in zip(plan.requests, runs, plan.num_new_tokens):
            if not req.finished:
                rows = kept.get(id(req))
                mine = features[row:row + n_valid] if rows is None else features[[row + j for j in rows]]
                self._drafter(req).add_features(start, mine)
            row += n_run

    def _release_finished(self) -> None:
        """Requests that finished (or were aborted) since the last step give their draft blocks back."""
        for r in self.drafting:
            if r.finished:
                r.drafter.release()
        self.drafting = [r for r in self.drafting if not r.finished]

    def alpha(self, r) -> float:
        """Acceptance probability of one draft: this request's record, pulled toward the engine's."""
        return estimate_alpha(r.num_accepted, r.num_rejections, prior=estimate_alpha(self.accepted, self.rejections))

    # --- 3. verify, 4. roll back -------------------------------------------------------------
    def verify(self, r, logits: torch.Tensor) -> tuple[list[int], list[int]]:
        """logits (1 + k, V) of the pending token and the k drafts -> the 1 + a tokens to append and the
        rows of the run they were chosen from (rows[0] = 0, the pending token's; then each accepted draft's
        row: 1 .. a for a chain, the accepted path's nodes for a tree). Updates the statistics and the
        proposer's own cache."""
        drafts = r.spec_token_ids
        if r.spec_parents is not None:                                       # NEW: tree drafts
            tree = DraftTree(list(drafts), list(r.spec_parents), [None] * len(drafts))
            tokens, path = verify_tree(tree, logits, r.params, r.generator)
            rows, rejected = [0] + [1 + n for n in path], bool(tree.children(path[-1] if path else -1))
            self.tree_verifications += 1
        else:
            if r.guide is not None:
                logits = guided_rows(r.guide, drafts, logits)
            tokens, accepted = verify(drafts, r.spec_probs, logits, r.params, r.generator)
            tokens, rows, rejected = tokens[:accepted + 1], list(range(accepted + 1)), accepted < len(drafts)
        accepted = len(rows) - 1
        r.num_accepted += accepted
        r.num_rejections += int(rejected)
        self.drafted += len(drafts)
        self.accepted += accepted
        self.rejections += int(rejected)
        self.verify_runs += 1
        if isinstance(r.drafter, ModelDraft):
            r.drafter.rollback(r.num_tokens + accepted)   # the context plus the accepted drafts
        r.spec_token_ids, r.spec_probs, r.spec_parents = [], None, None
        return tokens, rows

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


# --- speculation with structured output ----------------------------------------------------------

def guided_drafts(guide, drafts: list[int], q):
    """Drafts cut where the request's grammar forbids one. With a deterministic proposal (q None:
    n-gram, greedy draft model) the forbidden draft goes too: the target would reject it for sure
    and sample from its own masked distribution, which is what happens without it. A sampled draft
    keeps it: rejection sampling must then draw from the residual max(0, p - q), not from p."""
    automaton, state = guide.automaton, guide.state
    for j, token in enumerate(drafts):
        if not automaton.mask(state)[token]:
            keep = j if q is None else j + 1
            return drafts[:keep], (None if q is None else q[:keep])
        state = automaton.next_state(state, token)
    return drafts, q


def guided_rows(guide, drafts: list[int], logits: torch.Tensor) -> torch.Tensor:
    """logits (1 + k, V) -> the same rows masked by the grammar state each one continues: row i
    follows the pending token and drafts[:i]. Past a forbidden draft the rows are never used (it is
    rejected for sure), so they keep the last state's mask."""
    automaton, state = guide.automaton, guide.state
    rows = []
    for i in range(len(drafts) + 1):
        rows.append(logits[i].masked_fill(~automaton.mask(state).to(logits.device), float("-inf")))
        if i < len(drafts):
            nxt = automaton.next_state(state, drafts[i])
            state = state if nxt == automaton.dead else nxt
    return torch.stack(rows)                                                   # (1 + k, V)
