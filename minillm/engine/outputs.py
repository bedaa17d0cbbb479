"""Result objects with vLLM's names: RequestOutput -> outputs[0] (CompletionOutput), metrics."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int                   # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None   # "stop" (EOS or stop string) or "length"
    stop_reason: str | int | None = None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) of a request's life: arrived, first scheduled (its first prefill
    chunk ran), first token, finished."""
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0
    first_scheduled_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        """Seconds waiting before the first step that ran it."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """Seconds from the first step that ran it to its first token (every prefill chunk)."""
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """Seconds from the first token to the last."""
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean seconds between output tokens after the first (TPOT)."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default=None)
    num_cached_tokens: int = 0      # prompt tokens the prefix cache served, not computed (vLLM's field)
