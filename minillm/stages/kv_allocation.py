"""KV memory as an allocator sees it: a long-tailed request trace served from a fixed KV budget by
contiguous reservation (the vLLM paper's baselines, arXiv 2309.06180, section 6) or by the engine's own
BlockManager, one decode token per running request per step. No model runs: this is the bookkeeping
lesson 06 is about, simulated in steps so that the share of reserved memory holding real tokens can be
counted.

    contiguous "max"     reserve max_model_len slots per request (Orca Max)
    contiguous "pow2"    reserve the next power of two >= prompt + output (Orca Pow2)
    contiguous "oracle"  reserve exactly prompt + output (Orca Oracle: knows the future)
    paged                BlockManager blocks allocated as the sequence grows, preemption by recompute
                         (newest first) when a block is missing

Contiguous reservations come from a first-fit allocator over one flat slot range, so external
fragmentation is real: a request may wait although enough memory is free, only not in one piece.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np

from minillm.engine.request import Request as EngineRequest
from minillm.kvcache.block_manager import BlockManager


# --- the workload -----------------------------------------------------------------------

@dataclass
class TraceRequest:
    rid: int
    prompt_len: int
    output_len: int
    generated: int = 0                                  # output tokens whose K/V is stored
    engine_request: EngineRequest | None = None         # its synthetic tokens, what the BlockManager reads (paged only)

    @property
    def stored(self) -> int:
        return self.prompt_len + self.generated


def make_workload(num_requests: int, max_model_len: int, seed: int = 0) -> list[TraceRequest]:
    """Log-normal prompt and output lengths (median 150 each, sigma 1.0: most requests are short,
    a few are long, as in chat traces), clipped so that prompt + output <= max_model_len."""
    rng = np.random.default_rng(seed)
    prompts = np.clip(rng.lognormal(np.log(150), 1.0, num_requests), 4, max_model_len // 2).astype(int)
    outputs = np.clip(rng.lognormal(np.log(150), 1.0, num_requests), 2, max_model_len - prompts).astype(int)
    return [TraceRequest(i, int(p), int(o)) for i, (p, o) in enumerate(zip(prompts, outputs))]


# --- allocation policies ----------------------------------------------------------------

class FirstFit:
    """Contiguous reservations in one flat range of slots: first hole that fits, holes merged on free."""

    def __init__(self, size: int):
        self.holes = [(0, size)]                         # sorted (start, length)

    def can_allocate(self, n: int) -> bool:
        return any(length >= n for _, length in self.holes)

    def allocate(self, n: int) -> int:
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                self.holes[i:i + 1] = [(start + n, length - n)] if length > n else []
                return start
        raise RuntimeError(f"no contiguous hole of {n} slots")

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, n))
        self.holes.insert(i, (start, n))
        merged = []
        for hole in self.holes:                          # O(holes): fine at this scale
            if merged and merged[-1][0] + merged[-1][1] == hole[0]:
                merged[-1] = (merged[-1][0], merged[-1][1] + hole[1])
            else:
                merged.append(hole)
        self.holes = merged


class ContiguousPolicy:
    """Reserve a fixed number of slots per request at admission (how much depends on `mode`)."""

    def __init__(self, mode: str, budget: int, max_model_len: int):
        self.mode, self.max_model_len = mode, max_model_len
        self.memory = FirstFit(budget)
        self.free_slots = budget
        self.where: dict[int, tuple[int, int]] = {}
        self.fragmentation_stalls = 0                    # head request blocked by holes, not by size

    def reservation(self, r: TraceRequest) -> int:
        total = r.prompt_len + r.output_len
        if self.mode == "max":
            return self.max_model_len
        if self.mode == "pow2":
            return 1 << (total - 1).bit_length()
        return total                                     # oracle

    def try_admit(self, r: TraceRequest) -> bool:
        n = self.reservation(r)
        if not self.memory.can_allocate(n):
            self.fragmentation_stalls += n <= self.free_slots
            return False
        self.where[r.rid] = (self.memory.allocate(n), n)
        self.free_slots -= n
        return True

    def grow(self, r: TraceRequest, running: list[TraceRequest]) -> list[TraceRequest]:
        return []                                        # the reservation already covers it

    def release(self, r: TraceRequest) -> None:
        start, n = self.where.pop(r.rid)
        self.memory.free(start, n)
        self.free_slots += n

    def allocated(self) -> int:
        return sum(n for _, n in self.where.values())


class PagedPolicy:
    """The real BlockManager: blocks on demand; when one is missing, preempt the newest request."""

    def __init__(self, budget: int, block_size: int, watermark: float = 0.01):
        self.bm = BlockManager(budget // block_size, block_size)
        self.block_size = block_size
        self.watermark_blocks = int(watermark * self.bm.num_blocks)   # headroom kept at admission
        self.preemptions = 0
        self.recomputed_tokens = 0

    def try_admit(self, r: TraceRequest) -> bool:
        if r.engine_request is None:                     # ids do not matter: no prefix caching here
            r.engine_request = EngineRequest.from_token_ids(str(r.rid), [r.rid % 50000] * r.prompt_len)
        req = r.engine_request                           # after a preemption: prompt + its outputs so far
        need = -(-req.num_tokens // self.block_size)
        if self.bm.num_free_blocks - need < self.watermark_blocks:
            return False
        self.bm.allocate(req)
        req.num_computed_tokens = req.num_tokens         # prefill
        return True

    def grow(self, r: TraceRequest, running: list[TraceRequest]) -> list[TraceRequest]:
        """Append r's newest token; returns the requests preempted to make room."""
        preempted = []
        req = r.engine_request
        req.output_token_ids.append(7)
        while not self.bm.can_append_slots(req, req.num_tokens):
            victim = running[-1]                         # the most recently admitted
            self.release(victim)
            running.remove(victim)
            preempted.append(victim)
            self.preemptions += 1
            self.recomputed_tokens += victim.stored
            victim.prompt_len, victim.output_len = victim.stored, victim.output_len - victim.generated
            victim.generated = 0                         # readmitted later with everything it has
            if victim is r:
                req.output_token_ids.pop()
                return preempted
        self.bm.append_slots(req, req.num_tokens)
        req.num_computed_tokens = req.num_tokens         # its decode step
        return preempted

    def release(self, r: TraceRequest) -> None:
        self.bm.free(r.engine_request.request_id)

    def allocated(self) -> int:
        return (self.bm.num_blocks - self.bm.num_free_blocks) * self.block_size


def simulate(policy, requests: list[TraceRequest]) -> dict:
    """Serve a backlog FCFS; one decode token per running request per step.

    decode_steps counts scheduler steps until the backlog drains; a step with more running
    sequences costs more time, so it is not a throughput number by itself."""
    waiting = deque(TraceRequest(r.rid, r.prompt_len, r.output_len) for r in requests)
    running: list[TraceRequest] = []
    used_share, pool_used, num_running, trace = [], [], [], []
    steps = 0
    while waiting or running:
        while waiting and policy.try_admit(waiting[0]):
            running.append(waiting.popleft())
        if not running:
            raise RuntimeError(f"request {waiting[0].rid} does not fit the KV budget at all")
        used = sum(r.stored for r in running)
        allocated = policy.allocated()
        trace.append(len(running))
        if waiting:                                      # memory-bound phase: what we measure
            used_share.append(used / allocated)
            pool_used.append(used)
            num_running.append(len(running))
        for r in list(running):
            if r not in running:                         # preempted earlier in this step
                continue
            r.generated += 1
            if r.generated >= r.output_len:
                policy.release(r)
                running.remove(r)
            else:
                for victim in reversed(policy.grow(r, running)):
                    waiting.appendleft(victim)
        steps += 1
    return {"kv_utilization": float(np.mean(used_share)), "mean_running": float(np.mean(num_running)),
            "max_running": int(np.max(num_running)), "pool_tokens_used": float(np.mean(pool_used)),
            "decode_steps": steps, "trace": trace}
