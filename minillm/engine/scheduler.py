"""Continuous batching: decide, every step, which requests run and how many tokens each.

Plain Python over the block manager (minillm/kvcache/block_manager.py); no tensors, no model, so every
rule below is unit-tested on its own (tests/engine/test_scheduler.py).

Static batching (HF's batched generate) admits a batch, pads it, and runs until its LONGEST
request ends: short requests idle, new ones wait. Continuous batching re-decides every step:

    budget = max_num_batched_tokens                  # tokens one forward may process
    1. running requests, oldest first: each catches up by min(num_tokens - num_computed, budget)
       (1 for a decode, 1 + k with k speculative draft tokens, a chunk for an unfinished prefill;
       drafts that do not fit the budget are dropped). If its next tokens need a block
       and none is free, preempt the NEWEST running request (free its blocks; it goes back to
       the front of the waiting queue and later recomputes) until there is room.
    2. waiting requests, first come first served, while budget, max_num_seqs and free blocks
       allow: allocate blocks (a prefix-cache hit marks the cached tokens computed already),
       and schedule min(remaining prompt, budget) tokens: a prefill CHUNK if the prompt does
       not fit what is left of the budget (chunked prefill), so a long prompt never stalls
       the decodes sharing its step.

A request joins the step after it arrives and leaves on the step it finishes. With chunked
prefill off, a waiting prompt is admitted only if it fits whole into what is left of the budget.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from minillm.kvcache.block_manager import BlockManager
from .request import Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's plan: run num_new_tokens[i] tokens of requests[i], starting at its num_computed_tokens."""
    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, enable_chunked_prefill: bool = True):
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs = {max_num_seqs!r} is invalid; allowed: an integer >= 1")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens = {max_num_batched_tokens!r} is invalid; "
                             f"allowed: an integer >= 1")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []           # admission order: oldest first

    # --- queue management -----------------------------------------------------------------
    def add(self, request: Request) -> None:
        if not self.enable_chunked_prefill and request.num_tokens > self.max_num_batched_tokens:
            raise ValueError(f"prompt has {request.num_tokens} tokens but max_num_batched_tokens is "
                             f"{self.max_num_batched_tokens} and chunked prefill is off: it could never "
                             f"be scheduled; raise max_num_batched_tokens or enable chunked prefill")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request) -> None:
        """The request is done (stop, length or abort): it leaves and its blocks are freed."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.block_manager.free(request.request_id)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    # --- one step ---------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # BEGIN SOLUTION scheduler
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            self._fit_drafts(req, budget)
            n = min(req.num_tokens_with_spec - req.num_computed_tokens, budget)
            while not bm.can_append_slots(req, req.num_tokens_with_spec):
                victim = self.running[-1]                 # the newest gives its blocks back
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:   # it preempted itself: nothing left to free
                break
            out.block_copies += bm.append_slots(req, req.num_tokens_with_spec)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
            i += 1
        # 2. waiting requests, first come first served (none if this step had to preempt)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            use_cache = req.params.prompt_logprobs is None     # cached positions have no logits
            cached = bm.cached_prefix_tokens(req) if use_cache else 0
            remaining = req.num_tokens - cached
            if not self.enable_chunked_prefill and remaining > budget:
                break
            if not bm.can_allocate(req, use_prefix_cache=use_cache):
                break
            req.num_computed_tokens = bm.allocate(req, use_prefix_cache=use_cache)
            req.num_cached_tokens = req.num_computed_tokens
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            n = min(remaining, budget)
            out.requests.append(req)
            out.num_new_tokens.append(n)
            budget -= n
        return out
        # END SOLUTION

    def update(self, out: SchedulerOutput) -> list[Request]:
        """After the forward: the scheduled tokens are computed. Returns the requests whose last
        token was computed this step, i.e. the ones that now sample a new token."""
        sample = []
        for req, n in zip(out.requests, out.num_new_tokens):
            req.num_computed_tokens += n
            self.block_manager.cache_blocks(req)           # its newly full blocks become findable
            self.block_manager.free_outside_window(req)    # a sliding window: blocks no query will see go back
            if req.num_computed_tokens == req.num_tokens:
                sample.append(req)
        return sample

    @staticmethod
    def _fit_drafts(req: Request, budget: int) -> None:
        """Speculative draft tokens ride along with a request's pending token only as far as the
        step's token budget allows; the rest are dropped (they would be verified later anyway)."""
        if req.spec_token_ids:
            fits = max(0, budget - (req.num_tokens - req.num_computed_tokens))
            del req.spec_token_ids[fits:]
            if req.spec_probs is not None:
                req.spec_probs = req.spec_probs[:fits] if req.spec_token_ids else None
            if req.spec_parents is not None:          # a tree's nodes are in topological order: a prefix is a tree
                req.spec_parents = req.spec_parents[:fits] if req.spec_token_ids else None

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: free every block, forget the computed tokens, and put the
        request at the FRONT of the waiting queue so it resumes before anything newer."""
        # BEGIN SOLUTION scheduler
        self.running.remove(req)
        self.block_manager.free(req.request_id)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.spec_token_ids, req.spec_probs, req.spec_parents = [], None, None   # drafts are proposed afresh
        req.prompt_logits = []
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        # END SOLUTION

