"""Lesson 08's teaching stage: speculative decoding of ONE request, beside the engine.

    for delta in speculative_stream(llm, req, "ngram", k=4): ...

The loop of lesson 02's reference (minillm/stages/reference.py: one request on the contiguous cache, run by
fast_decode.FastDecoder), with a draft and a verification added; what differs from that loop is
marked # NEW. The rules it applies (verification, the adaptive policy) and the drafts come from
minillm/speculative/core.py, which the engine's speculation (minillm/speculative/engine.py) shares; the
engine never runs this file: there drafts ride in the batched steps. Tested token-identical to plain
decoding at temperature 0 (tests/speculative/test_speculative.py).
"""
from __future__ import annotations

import time
from typing import Iterator

import torch

from minillm.model.positions import RopeTable
from minillm.speculative.core import (MAX_SPECULATIVE_TOKENS, ModelDraft, SpecStats, StepCostModel, check_args, estimate_alpha,
                                      make_draft, plan_draft_lengths, verify)
from .fast_decode import FastDecoder
from .kv_cache import KVCache, forward_cached


class Stepper:
    """One sequence's contiguous KV cache plus lesson 02's batch-1 forward that extends it
    (fast_decode.FastDecoder: the fast loop and compiled step where they apply, else the baseline)."""

    def __init__(self, decoder: FastDecoder, max_len: int):
        model = decoder.model
        weight = model.embed.weight
        self.decoder = decoder
        self.cache = KVCache(model.cfg, 1, max_len, weight.dtype, weight.device)
        self.rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, max_len, weight.device, model.cfg.rope_scaling)

    @property
    def length(self) -> int:
        return int(self.cache.lengths[0])

    def step(self, tokens: list[int]) -> torch.Tensor:
        """Feed tokens; logits (V,) of the last one."""
        ids = torch.tensor([tokens], device=self.cache.k.device)          # (1, T)
        return self.decoder.forward(ids, self.cache, self.rope)[0]

    def step_all(self, tokens: list[int]) -> torch.Tensor:
        """NEW: feed tokens; logits (T, V) of every one (verification needs all k + 1): k + 1 tokens by
        the compiled verification step (fast_decode item 7) where it applies, else (a longer run,
        such as a prompt whose logprobs are asked for, or the baseline model) by forward_cached."""
        ids = torch.tensor([tokens], device=self.cache.k.device)          # (1, T)
        if self.decoder.can_verify and len(tokens) <= MAX_SPECULATIVE_TOKENS + 1:
            return self.decoder.verify(ids, self.cache, self.rope)
        return forward_cached(self.decoder.model, ids, self.cache, all_logits=True)[0]

    def rollback(self, length: int) -> None:
        """NEW: forget cached positions >= length (rejected guesses)."""
        self.cache.truncate(torch.tensor([length], device=self.cache.lengths.device))


@torch.no_grad()
def speculative_stream(llm, req, method: str, k: int, stats: SpecStats | None = None,
                       draft=None, decoder: FastDecoder | None = None) -> Iterator[str]:
    """Run one request with speculative decoding, yielding new visible text after every token
    (the contract of reference.stream_contiguous). draft: a proposer from speculative.core.make_draft
    (built if None); decoder: a FastDecoder of llm.model to reuse (built if None)."""
    check_args(method, k)
    draft = draft or make_draft(llm.model, method)                          # NEW: draft
    decoder = decoder or FastDecoder(llm.model, attention_backend=llm.attention_backend)
    stats = stats if stats is not None else SpecStats()
    stats.k = k
    params = req.params
    # NEW: adaptive. t(T) = a + b T of a target call over T tokens, fitted to this request's calls; a
    # round drafts only the guesses that pay (plan_draft_lengths with one request).
    cost = StepCostModel() if getattr(llm, "speculative_policy", "always") == "adaptive" else None
    room = min(llm.max_model_len, len(req.prompt_token_ids) + params.max_tokens) + k + 1
    target = Stepper(decoder, room)
    if isinstance(draft, ModelDraft):
        draft.reset(room)                                                   # NEW: the draft's own cache
    try:
        # Prefill exactly as the plain runner does; the first token is sampled from the target.
        if params.prompt_logprobs is not None:
            logits = target.step_all(req.prompt_token_ids)                      # (T, V)
            llm.output_processor.set_prompt_logprobs(req, logits)
            logits = logits[-1]
        else:
            logits = target.step(req.prompt_token_ids)                          # (V,)
        yield llm.output_processor.append(req, logits)
        while not req.finished:
            context = req.all_token_ids                # the target's cache holds all but the last
            left = min(params.max_tokens - len(req.output_token_ids), llm.max_model_len - len(context))
            k_round = min(k, left - 1)
            if cost is not None and k_round > 0:
                alpha = estimate_alpha(stats.accepted, stats.rejections)
                per_draft = stats.draft_seconds / stats.drafted if stats.drafted and isinstance(draft, ModelDraft) else 0.0
                k_round = plan_draft_lengths([alpha], [k_round], 1, 1, cost.fit(), per_draft)[0]
            t0 = time.perf_counter()
            guesses, q = draft.propose(context, k_round, params, req.generator)    # NEW: draft
            t1 = time.perf_counter()
            if guesses:
                logits = target.step_all(context[-1:] + guesses)                    # NEW: (n+1, V) at once
            else:
                logits = target.step(context[-1:])[None]                            # (1, V) plain step
            if cost is not None:
                cost.observe(1 + len(guesses), time.perf_counter() - t1)
            tokens, accepted = verify(guesses, q, logits, params, req.generator)    # NEW: accept/reject
            stats.target_seconds += time.perf_counter() - t1
            stats.draft_seconds += t1 - t0
            # NEW: roll back. Both caches keep the context plus the accepted guesses; the token the
            # target just added is fed at the start of the next round.
            kept = len(context) + accepted
            target.rollback(kept)
            draft.rollback(kept)
            _count(stats, len(guesses), accepted)
            for i in range(accepted + 1):
                yield llm.output_processor.append(req, logits[i], tokens[i])   # the verifier's token
                if req.finished:                       # a stop inside the run discards the rest
                    return
    finally:
        draft.release()                                # NEW: a draft model's blocks go back to its pool


def _count(stats: SpecStats, drafted: int, accepted: int) -> None:
    stats.target_calls += 1
    stats.drafted += drafted
    stats.accepted += accepted
    stats.rejections += int(accepted < drafted)
    stats.emitted += accepted + 1
    stats.accepted_per_call.append(accepted)
