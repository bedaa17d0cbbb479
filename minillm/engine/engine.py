"""The engine: scheduler -> model runner on the paged cache -> sampler -> outputs, once per step.

    engine.add_request(req)         # from LLM.make_requests: tokenised and validated
    while engine.has_unfinished():
        for req, delta in engine.step():   # every request that got a token this step
            ...                            # stream delta; req.finished tells when it is done

One step:
  1. Scheduler.schedule() picks requests and a token count for each under the budgets
     (minillm/engine/scheduler.py), growing their block tables; copy-on-write pairs are copied.
  2. The runner computes all those tokens in one flat forward (minillm/model/runner.py)
     and returns logits only for rows that need them: the last token of a request whose
     computed tokens caught up with its tokens, or every prompt row for prompt_logprobs.
  3. Those requests sample a token (per-request SamplingParams and generator; the output
     processor, minillm/engine/output_processor.py, also applies stop strings, EOS and max_tokens and
     detokenises); finished ones leave and free their blocks at once, so the next step can
     admit someone new.

The LLM tokenises and validates; the engine owns the batching, the output processor what
reaches the user. Per-step metrics (batch size, tokens, decodes, prefill tokens, preemptions)
for the last STEP_LOG_LEN steps are kept in engine.step_log for lessons and benchmarks.
"""
from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from minillm.config import EngineConfig, resolve_num_kv_blocks
from minillm.kvcache.block_manager import BlockManager
from minillm.model.cuda_graphs import make_decode_graphs
from minillm.model.runner import GROUP_COST_BLOCKS, ModelRunner, PagedKVCache, build_batch
from .request import Request
from .scheduler import Scheduler

STEP_LOG_LEN = 10_000                   # engine.step_log keeps the last this many steps (a server runs for days)


def _run_parents(req: Request, n: int) -> list[int] | None:
    """NEW: tree drafts: a request's run as build_batch's tree (row t follows row parents[t]): the pending token,
    then each node after its parent's row; None for a chain or any other run."""
    if req.spec_parents is None:
        return None
    return [-1] + [1 + p for p in req.spec_parents][:n - 1]


class StepLog(deque):
    """A bounded deque of per-step dicts that slices like a list: readers take log[first:]."""

    def __getitem__(self, i):
        if isinstance(i, slice):
            return list(itertools.islice(self, *i.indices(len(self))))
        return super().__getitem__(i)


class Engine:
    def __init__(self, llm, config: EngineConfig | None = None, speculation=None, triton_on_cpu: bool = False):
        """config: the validated EngineConfig (minillm/config.py; None: llm.engine_config), read
        here and nowhere re-checked. Decode-only steps replay CUDA graphs where the runner uses the
        Triton paged path and config.run.enforce_eager is False (minillm/model/cuda_graphs.py).
        triton_on_cpu: that path on CPU under TRITON_INTERPRET=1 (tests). config.run.tune_kernels:
        the build's one timing step (GEMM library per weight shape, ModelRunner); False: defaults."""
        config = llm.engine_config if config is None else config
        cfg, dtype = llm.config, llm.model.embed.weight.dtype
        cache, sched = config.cache, config.scheduler
        num_kv_blocks = resolve_num_kv_blocks(config, cfg, dtype)
        self.config = config
        self.llm = llm
        self.output_processor = llm.output_processor
        self.block_manager = BlockManager(num_kv_blocks, cache.block_size, cache.enable_prefix_caching,
                                          cache.prefix_cache, cfg.sliding_window)
        self.scheduler = Scheduler(self.block_manager, sched.max_num_seqs, sched.max_num_batched_tokens,
                                   sched.enable_chunked_prefill)
        if getattr(llm, "parallel", None) is None:
            self.kv = PagedKVCache(cfg, num_kv_blocks, cache.block_size, dtype, llm.device, cache.kv_cache_dtype)
            self.runner = ModelRunner(llm.model, self.kv, llm.rope, prepack_rows=sched.max_num_seqs,
                                      triton_on_cpu=triton_on_cpu, tune_kernels=config.run.tune_kernels,
                                      compile_steps=True, attention_backend=config.run.attention_backend)
            if not config.run.enforce_eager and speculation is None:     # drafts make multi-token rows: eager
                self.runner.graphs = make_decode_graphs(self.runner, sched.max_num_seqs, config.blocks_per_sequence)
        else:           # tensor/pipeline parallel: each rank builds its part of the cache (minillm/parallel); no graphs
            self.kv, self.runner = llm.parallel.start_engine(llm.model, llm.rope, num_kv_blocks, cache.block_size,
                                                             cache.kv_cache_dtype)
        # runner.group_by_length, for the gathering CPU backends; the C and Triton kernels take every decode row
        self.decode_group_cost = GROUP_COST_BLOCKS if self.runner.attention.groups_decodes else None
        self.requests: dict[str, Request] = {}
        self.step_log = StepLog(maxlen=STEP_LOG_LEN)
        self.speculation = speculation          # a speculative.engine.EngineSpeculation, or None

    # --- requests ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the engine")
        self.scheduler.add(req)
        self.requests[req.request_id] = req

    def abort_request(self, request_id: str) -> None:
        """Stop a request now (a client went away); its blocks go back to the pool."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        if not req.finished:
            req.finish_reason = "abort"
        self.scheduler.finish(req)        # also when it finished but a step failed before freeing it

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[tuple[Request, str]]:
        """Schedule, execute, sample, update. -> (request, new visible text) for every request
        that got tokens this step."""
        t0 = time.perf_counter()
        if self.speculation is not None:                                   # NEW: speculative, 1. propose
            self.speculation.propose(self.scheduler.running, self.scheduler.max_num_batched_tokens,
                                     getattr(self.runner, "tree_rows", 0))
        plan = self.scheduler.schedule()
        now = time.time()
        for req in plan.requests:
            if req.metrics.first_scheduled_time is None:                   # its queue time ends here
                req.metrics.first_scheduled_time = now
        if not plan.requests:
            if self.scheduler.has_unfinished():
                raise RuntimeError("the scheduler could not schedule anything although requests wait; "
                                   "the KV pool is too small for them")
            return []
        self.kv.copy_blocks(plan.block_copies)
        batch, wants, spans = self._prepare(plan)
        log = self._step_counts(plan)                                      # before the update moves the counts
        if batch.feature_rows is None:
            logits = self.runner.forward(batch)                            # (K, V)
        else:                                                              # NEW: EAGLE drafts read the features
            runs = [(req.num_computed_tokens, n) for req, n in zip(plan.requests, plan.num_new_tokens)]   # as scheduled
            logits, features = self.runner.forward_with_features(batch)    # (K, V), (F, dim)
        verified, kept, events = self._verify(plan, spans, logits, log)
        if batch.feature_rows is not None:                                 # the verified positions' features
            self.speculation.take_features(plan, runs, features, kept)
        events += self._sample_and_update(plan, wants, spans, logits, verified)
        self._log(log, plan, verified, t0)
        return events

    def _prepare(self, plan) -> tuple:
        """The step's flat batch (runner.build_batch); per request which logits rows it needs
        ("all": prompt logprobs or drafts to verify, "last": it samples, "none": a prefill chunk) and
        where they sit in the runner's output: spans[i] = (first row, end row)."""
        bm = self.block_manager
        runs, wants, spans, row = [], [], [], 0
        for req, n in zip(plan.requests, plan.num_new_tokens):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            wants_prompt = req.params.prompt_logprobs is not None and req.prompt_logprobs is None
            want = "all" if wants_prompt or req.spec_token_ids else ("last" if end == req.num_tokens else "none")
            runs.append(((req.all_token_ids + req.spec_token_ids)[start:end], start, bm.block_table(req.request_id),
                         bm.slot_mapping(req.request_id, start, end), _run_parents(req, end - start)))
            wants.append(want)
            rows = n if want == "all" else int(want == "last")
            spans.append((row, row + rows))
            row += rows
        features = None if self.speculation is None else self.speculation.wants_features(plan.requests)
        return (build_batch(runs, wants, bm.block_size, self.kv.k.device, self.decode_group_cost,
                            self.llm.config.sliding_window, features), wants, spans)

    def _verify(self, plan, spans, logits, log) -> tuple[dict, dict, list]:
        """NEW: speculative, 3. verify and 4. roll back. -> {id(req): (the target's own token, its
        logits row)} for every request whose drafts ran, {id(req): the rows of its run that stand},
        and the accepted drafts' output events. A tree's accepted path moves its K/V to the slots
        right after the pending token, where a chain's already is."""
        verified, kept, events = {}, {}, []
        for i, req in enumerate(plan.requests):
            if not req.spec_token_ids:
                continue
            lo, hi = spans[i]
            start = req.num_computed_tokens
            log["num_draft_tokens"] += len(req.spec_token_ids)
            tokens, rows = self.speculation.verify(req, logits[lo:hi])
            a = len(rows) - 1
            log["num_accepted_tokens"] += a
            for j in range(a):                                             # acceptance by draft position
                log["num_accepted_per_position"][j] += 1
            if rows != list(range(a + 1)):                                 # NEW: tree drafts, the path compacted
                slots = self.block_manager.slot_mapping(req.request_id, start, start + rows[-1] + 1)
                self.kv.move_slots([slots[r] for r in rows[1:]], slots[1:a + 1])
            plan.num_new_tokens[i] = 1 + a                                 # the rejected drafts roll back
            self.block_manager.truncate(req, start + 1 + a)
            for j in range(a):                                             # the accepted drafts are output now
                events.append((req, self.output_processor.append(req, logits[lo + rows[j]], tokens[j])))
                if req.finished:                                           # a stop inside the run: the rest is dropped
                    break
            verified[id(req)], kept[id(req)] = (tokens[a], lo + rows[a]), rows
        return verified, kept, events

    def _sample_and_update(self, plan, wants, spans, logits, verified) -> list:
        """Move every request's computed count on (Scheduler.update); those that caught up sample a
        token; finished ones leave and free their blocks at once."""
        to_sample = set(map(id, self.scheduler.update(plan)))
        # greedy rows: one argmax over the whole (K, V) block, in fp32 (bf16 is slower on CPU), as
        # max(-1).indices: the same first maximal index, and faster than argmax(-1) on CPU;
        # guided rows must take the argmax of their masked logits: the output processor does it
        any_greedy = any(r.params.greedy and r.guide is None for r in plan.requests
                         if id(r) in to_sample and id(r) not in verified)
        greedy = logits.float().max(-1).indices.tolist() if any_greedy else []
        events = []
        for req, want, (lo, hi) in zip(plan.requests, wants, spans):
            if want == "all" and id(req) not in verified:
                req.prompt_logits.append(logits[lo:hi])                    # (T_chunk, V)
                if req.num_computed_tokens >= len(req.prompt_token_ids):
                    self.output_processor.set_prompt_logprobs(req, torch.cat(req.prompt_logits))
                    req.prompt_logits = []
            if id(req) in to_sample and not req.finished:
                if id(req) in verified:
                    token, last = verified[id(req)]
                else:
                    last = hi - 1
                    token = greedy[last] if req.params.greedy and req.guide is None else None
                events.append((req, self.output_processor.append(req, logits[last], token)))
            if req.finished and req.request_id in self.requests:
                self.scheduler.finish(req)
                del self.requests[req.request_id]
        return events

    def _step_counts(self, plan) -> dict:
        decodes = sum(1 for r in plan.requests
                      if r.num_computed_tokens == r.num_tokens - 1 and r.num_tokens > len(r.prompt_token_ids))
        return {"num_seqs": len(plan.requests), "num_tokens": plan.num_batched_tokens,   # drafts included
                "num_decodes": decodes, "num_preempted": len(plan.preempted),
                "num_draft_tokens": 0, "num_accepted_tokens": 0,
                "num_accepted_per_position": [0] * (0 if self.speculation is None else self.speculation.k)}

    def _log(self, log: dict, plan, verified: dict, t0: float) -> None:
        seconds = time.perf_counter() - t0
        if self.speculation is not None:
            self.speculation.cost.observe(log["num_tokens"], seconds)
        self.step_log.append({"time": time.perf_counter(), "seconds": seconds, **log,
                              "num_running": len(self.scheduler.running),
                              "num_waiting": len(self.scheduler.waiting),
                              "free_blocks": self.block_manager.num_free_blocks,
                              "num_verified_requests": len(verified)})

    def run(self, requests: list[Request], progress=None) -> None:
        """Add every request and step until all are finished (progress: a tqdm bar or None).
        On an error or Ctrl-C the requests of this call are aborted, their blocks freed: the
        next call must not silently finish them."""
        try:
            for req in requests:
                self.add_request(req)
            while self.has_unfinished():
                for req, _ in self.step():
                    if req.finished and progress is not None:
                        progress.update(1)
        finally:
            for req in requests:
                if self.requests.get(req.request_id) is req:     # not a clashing id of someone else's
                    self.abort_request(req.request_id)
