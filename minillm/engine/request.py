"""A request in flight: its tokens so far, how many of them are in the KV cache, and its state.

The one number that drives the engine (vLLM v1's framing) is num_computed_tokens: how many
of the request's tokens (prompt + output so far) already have their K/V in the cache. Each
step the scheduler lets it catch up with num_tokens by some amount:

    prefill            num_computed 0          -> len(prompt)     (in one step or in chunks)
    prefix-cache hit   num_computed starts at the cached tokens, not 0
    decode             num_computed n - 1      -> n               (one token per step)
    speculative step   num_computed n - 1      -> n + k           (the pending token + k drafts)
                       then back to n + a: the a accepted drafts stay, the rejected ones roll back
    preemption         num_computed back to 0  (its blocks were freed; it recomputes)

When num_computed_tokens reaches num_tokens the last forward produced the logits of the last
token, so a new token is sampled and appended, and num_tokens grows by one.

A Request is the one record of a request's tokens and count: the block manager
(minillm/kvcache/block_manager.py) reads both from it and keeps only its block table.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from .outputs import Logprob, RequestMetrics
from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # not admitted yet, or preempted (its blocks were freed)
    RUNNING = "running"        # holds KV blocks, gets scheduled every step
    FINISHED = "finished"      # stop condition met, length reached, or aborted


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    metrics: RequestMetrics
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list | None = None
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None       # "stop", "length" or "abort"
    stop_reason: str | int | None = None
    emitted: int = 0                       # characters of text already streamed
    # incremental detokenising (OutputProcessor.detokenize): output tokens [detok_window:] are decoded again at the
    # next token; the text of [:detok_read] is in `text`
    detok_window: int = 0
    detok_read: int = 0
    # engine state
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0             # prompt tokens served by the prefix cache (last admission)
    num_preemptions: int = 0
    prompt_logits: list = field(default_factory=list)   # (T_chunk, V) pieces, for prompt_logprobs
    guide: object | None = None            # guided decoding: a minillm.guided GuideState (None: free text)
    # speculative decoding in the engine (minillm/speculative/engine.py)
    spec_token_ids: list[int] = field(default_factory=list)   # draft tokens to verify in the next step
    spec_probs: torch.Tensor | None = None # (k, V) the draft's distribution; None: one-hot (n-gram, greedy)
    spec_parents: list[int] | None = None  # NEW: tree drafts: the node each draft follows (-1: the pending token);
                                           # None: a chain (each draft follows the one before)
    drafter: object | None = None          # this request's proposer (a draft model keeps its own cache)
    num_accepted: int = 0                  # draft tokens accepted so far
    num_rejections: int = 0                # verification steps that ended in a rejection

    @classmethod
    def from_token_ids(cls, request_id: str, token_ids: list[int]) -> Request:
        """A bare request holding only prompt token ids (default SamplingParams, no text, no
        generator): enough to drive the block manager in its counting helpers, simulations and tests."""
        return cls(request_id, None, list(token_ids), SamplingParams(), None, RequestMetrics(0.0))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens_with_spec(self) -> int:
        return self.num_tokens + len(self.spec_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
