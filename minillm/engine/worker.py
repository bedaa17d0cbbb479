"""The one thread that steps the engine, for the HTTP server (lesson 09, section 3).

    handlers (event loop)                               the engine's thread (owns llm.engine)
    worker.submit(req, sink)  ----- inbox queue ----->  add_request(req)
                                                        step() -> (req, delta) for each request
    await sink's asyncio.Queue <- call_soon_threadsafe   push Delta(text, finish_reason) to its sink
    worker.abort(id)          ----- inbox queue ----->  abort_request(id): its KV blocks are freed

The engine is not thread-safe, so nothing else calls it: the worker publishes what others
may read (stats for /debug/engine, Prometheus metrics for /metrics) after each step.

Which thread steps it matters on a CPU. torch's OpenMP runtime (libgomp) keeps a pool of worker
threads per thread that opens parallel regions; once the pools together hold more threads than
there are cores, every pool spins only ~100 times at its barriers before sleeping in the kernel,
so each parallel region (several per layer) pays a futex wake-up. The thread that loaded and warmed
the model already owns a pool, so `minillm serve` steps the engine on that thread (`run()`) and
puts the HTTP event loop on another; `start()` runs the loop on a new thread instead, for servers
inside a test or a notebook.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .request import Request

log = logging.getLogger("minillm.serving.server")


@dataclass(frozen=True)
class Delta:
    """What the engine thread tells a handler after a step: new text, and whether it is over."""
    text: str
    finish_reason: str | None          # "stop", "length", "abort"; None while running
    num_output_tokens: int
    error: str | None = None
    client_error: bool = False         # the error is the request's fault (a 400, not a 500)


@dataclass
class _Sink:
    """Where one request's deltas go: an asyncio.Queue owned by the handler's event loop."""
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def push(self, delta: Delta) -> None:
        push_all([(self, delta)])


def _deliver(items: list[tuple[asyncio.Queue, Delta]]) -> None:
    for queue_, delta in items:
        queue_.put_nowait(delta)


def push_all(pushes: list[tuple[_Sink, Delta]]) -> None:
    """Hand deltas to their handlers' queues with one wake-up of each event loop (a write to its self-pipe), not one
    per request: a step's deltas for 64 requests cost the engine's thread one call, not 64."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for sink, delta in pushes:
        by_loop.setdefault(sink.loop, []).append((sink.queue, delta))
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):    # the loop has closed: nobody is listening any more
            loop.call_soon_threadsafe(_deliver, items)


class EngineFailure(Exception):
    def __init__(self, message: str, client_error: bool = False):
        super().__init__(message)
        self.client_error = client_error


class QueueFull(Exception):
    pass


class _Metrics:
    """vLLM's Prometheus metric names (vllm/v1/metrics/loggers.py), in a registry of their own
    so that several servers in one process (tests, notebooks) do not share counters."""

    TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
    ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
    TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled", registry=r)
        # what --max-waiting limits: also counts requests still in the inbox and those mid-prefill
        self.without_output = Gauge("minillm:num_requests_without_output",
                                    "Accepted requests with no output token yet (the 429 limit applies to these)",
                                    registry=r)
        self.rejected = Counter("minillm:requests_rejected", "Requests refused with 429: the queue was full",
                                registry=r)
        self.finished = Counter("vllm:request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV cache usage (1 = 100%)", registry=r)
        self.kv_free = Gauge("minillm:kv_blocks_free", "Free KV blocks", registry=r)
        self.kv_used = Gauge("minillm:kv_blocks_used", "KV blocks held by requests", registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served by the prefix cache", registry=r)
        self.short_prefix = Counter("minillm:prefix_cache_short_shared_prefix", "Prompts that share a prefix "
                                    "with an earlier prompt that is shorter than one KV block (it cannot hit: the "
                                    "cache reuses whole blocks)", registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Speculative verifications (one per request "
                                   "and step with drafts)", registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            registry=r)
        # the j-th draft (0-based) of a verification was accepted: the acceptance curve by draft position
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted draft tokens by their position among the drafts", ["position"],
                                             registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", buckets=self.TIME_BUCKETS,
                              registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Mean time per output token after the first",
                              buckets=self.TIME_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between a request's successive steps "
                             "with output (what a streaming client waits between chunks)",
                             buckets=self.ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token",
                             buckets=self.TIME_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Arrival to the first step that runs it",
                                    buckets=self.TIME_BUCKETS, registry=r)
        self.prefill_time = Histogram("vllm:request_prefill_time_seconds", "First step that runs it to its "
                                      "first token", buckets=self.TIME_BUCKETS, registry=r)
        self.decode_time = Histogram("vllm:request_decode_time_seconds", "First token to last token",
                                     buckets=self.TIME_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                               buckets=self.TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Output tokens per request",
                                                   buckets=self.TOKEN_BUCKETS, registry=r)
        for reason in ("stop", "length", "abort", "error"):     # present at 0 before the first one
            self.finished.labels(reason)

    def first_token(self, req: Request) -> None:
        self.prompt_tokens.inc(len(req.prompt_token_ids))
        self.prefix_queries.inc(len(req.prompt_token_ids))
        self.prefix_hits.inc(req.num_cached_tokens)
        self.ttft.observe(req.metrics.time_to_first_token)
        self.request_prompt_tokens.observe(len(req.prompt_token_ids))
        m = req.metrics
        for histogram, value in ((self.queue_time, m.queue_time), (self.prefill_time, m.prefill_time)):
            if value is not None:
                histogram.observe(value)

    def finished_request(self, req: Request) -> None:
        m = req.metrics
        self.finished.labels(req.finish_reason).inc()
        self.request_generation_tokens.observe(len(req.output_token_ids))
        for histogram, value in ((self.tpot, m.time_per_output_token), (self.e2e, m.e2e_latency),
                                 (self.decode_time, m.decode_time)):
            if value is not None:
                histogram.observe(value)


class ShortPrefixWatch:
    """Spots prompts that share a prefix with an earlier prompt that is shorter than one KV block. The prefix cache
    reuses whole blocks only, so such a prefix can never hit: a short shared system prompt and a hit rate of zero
    surprise operators (vLLM's users among them). Keeps the first block of the last `capacity` prompts."""

    MIN_SHARED = 4                      # fewer shared tokens is chance (a chat template's first tokens, say)

    def __init__(self, block_size: int, capacity: int = 4096):
        self.block_size, self.capacity = block_size, capacity
        self.prefixes: collections.Counter = collections.Counter()    # every prefix of a kept first block
        self.kept: collections.deque = collections.deque()

    def shared(self, prompt: list[int]) -> int:
        """The longest prefix of `prompt`, up to one block, that a kept prompt starts with (0: none)."""
        return max((k for k in range(1, min(len(prompt), self.block_size) + 1) if tuple(prompt[:k]) in self.prefixes),
                   default=0)

    def observe(self, prompt: list[int]) -> int:
        """Remember `prompt`; -> the length of a shared prefix too short to hit (0 if none or long enough)."""
        k = self.shared(prompt)
        head = prompt[:self.block_size]
        self.kept.append(head)
        self.prefixes.update(tuple(head[:j]) for j in range(1, len(head) + 1))
        if len(self.kept) > self.capacity:
            old = self.kept.popleft()
            self.prefixes.subtract(tuple(old[:j]) for j in range(1, len(old) + 1))
            self.prefixes += collections.Counter()                    # drop the zero counts
        return k if self.MIN_SHARED <= k < self.block_size and len(prompt) > self.block_size else 0


class EngineWorker:
    """The loop that calls the engine, on one thread: the caller's (`run`) or a new one (`start`). Others talk to
    it only through `inbox`."""

    _STOP = object()

    def __init__(self, llm, max_waiting: int = 256):
        self.engine = llm.engine                  # built here: it allocates the KV pool
        self.max_waiting = max_waiting
        self.inbox: queue.Queue = queue.Queue()
        self.sinks: dict[str, _Sink] = {}         # request_id -> sink, for requests in the engine
        # request_ids submitted that have no output yet; handlers add, the engine thread removes
        self._not_started: set[str] = set()
        self._lock = threading.Lock()
        self.metrics = _Metrics()
        self.last_output_time: dict[str, float] = {}   # request_id -> when its last step with output ended
        bm = self.engine.block_manager
        self.short_prefix = None if bm.prefix_cache is None else ShortPrefixWatch(bm.block_size)
        self.short_prefix_warned = False
        self.stats = self._snapshot()
        self.idle = True                          # blocked on an empty inbox: no progress is due
        self.last_progress = time.monotonic()
        self.thread: threading.Thread | None = None     # the thread that steps the engine, once running
        self._started_thread = False

    def start(self) -> None:
        """Step the engine on a new thread (a server inside a test or a notebook)."""
        self.thread = threading.Thread(target=self.run, name="minillm-engine", daemon=True)
        self._started_thread = True
        self.thread.start()

    def run(self) -> None:
        """Step the engine on the calling thread until stop() (`minillm serve`: the thread that loaded the
        model, whose OpenMP pool the steps then use; see the module's docstring)."""
        self.thread = self.thread or threading.current_thread()
        while self._take_commands(wait=not self.engine.has_unfinished()):
            if self.engine.has_unfinished():
                self._step()
            self.stats = self._snapshot()
            self.last_progress = time.monotonic()

    # called from other threads
    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def stop(self) -> None:
        """End the loop after the commands queued before this one; waits for a thread that start() made."""
        self.inbox.put(self._STOP)
        if self._started_thread and self.thread is not threading.current_thread():
            self.thread.join()

    @property
    def num_without_output(self) -> int:
        return len(self._not_started)

    def submit(self, req: Request, sink: _Sink) -> None:
        """Queue a request; QueueFull when max_waiting requests already wait for their first token."""
        with self._lock:                          # handlers of one loop, but check-then-add must be atomic
            if len(self._not_started) >= self.max_waiting:
                self.metrics.rejected.inc()
                raise QueueFull(f"{len(self._not_started)} requests are waiting for their first token "
                                f"(the server's limit, --max-waiting, is {self.max_waiting}); try again later")
            self._not_started.add(req.request_id)
            self.metrics.without_output.set(len(self._not_started))
        self.inbox.put(("add", req, sink))

    def abort(self, request_id: str) -> None:
        self.inbox.put(("abort", request_id))

    def stalled_for(self) -> float:
        """Seconds without progress although work is queued (0 when idle)."""
        return 0.0 if self.idle else time.monotonic() - self.last_progress

    # the engine's thread
    def _take_commands(self, wait: bool) -> bool:
        """Apply every queued command (blocking for the first one when idle). False on stop."""
        commands = []
        if wait:
            self.idle = True
            commands.append(self.inbox.get())
            self.idle, self.last_progress = False, time.monotonic()
        with contextlib.suppress(queue.Empty):
            while True:
                commands.append(self.inbox.get_nowait())
        for command in commands:
            if command is self._STOP:
                for request_id in list(self.sinks):
                    self._abort(request_id)
                return False
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._abort(command[1])
        return True

    def _add(self, req: Request, sink: _Sink) -> None:
        try:
            self.engine.add_request(req)
        except Exception as e:                    # refuse this request only; the thread keeps serving
            client_error = isinstance(e, ValueError)       # the engine's checks of a request raise ValueError
            if not client_error:
                log.exception("engine.add_request failed")
            self._started(req.request_id)
            self.metrics.finished.labels("error").inc()
            sink.push(Delta("", None, 0, error=f"the engine refused the request: {e}", client_error=client_error))
            return
        self.sinks[req.request_id] = sink

    def _started(self, request_id: str) -> None:
        with self._lock:
            self._not_started.discard(request_id)
            self.metrics.without_output.set(len(self._not_started))

    def _abort(self, request_id: str) -> None:
        sink = self.sinks.pop(request_id, None)
        self.last_output_time.pop(request_id, None)
        if sink is None:                          # it finished before the abort arrived
            return
        self._started(request_id)
        self.engine.abort_request(request_id)
        self.metrics.finished.labels("abort").inc()
        sink.push(Delta("", "abort", 0))

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as e:                    # keep serving: fail the requests in flight, free their blocks
            log.exception("engine step failed")
            for request_id, sink in list(self.sinks.items()):
                self.engine.abort_request(request_id)
                self._started(request_id)
                sink.push(Delta("", None, 0, error=f"engine step failed: {e}"))
            self.metrics.finished.labels("error").inc(len(self.sinks))
            self.sinks.clear()
            self.last_output_time.clear()
            return
        self.metrics.preemptions.inc(self.engine.step_log[-1]["num_preempted"])
        self.metrics.generation_tokens.inc(len(events))          # one new token per event
        log_entry = self.engine.step_log[-1]
        if log_entry.get("num_draft_tokens"):                     # speculative decoding verified drafts
            self.metrics.spec_drafts.inc(log_entry["num_verified_requests"])
            self.metrics.spec_draft_tokens.inc(log_entry["num_draft_tokens"])
            self.metrics.spec_accepted_tokens.inc(log_entry["num_accepted_tokens"])
            for position, count in enumerate(log_entry["num_accepted_per_position"]):
                self.metrics.spec_accepted_per_pos.labels(str(position)).inc(count)
        # with speculative decoding one request may get several tokens (events) in a step: only its
        # last event carries the finish
        last = {req.request_id: i for i, (req, _) in enumerate(events)}
        now = time.time()
        pushes = []
        for i, (req, text) in enumerate(events):
            if len(req.output_token_ids) == 1:                    # never with drafts: they follow the first
                self._started(req.request_id)
                self.metrics.first_token(req)
                self._watch_prefix(req)
            sink = self.sinks[req.request_id]
            final = last[req.request_id] == i
            pushes.append((sink, Delta(text, req.finish_reason if final else None, len(req.output_token_ids))))
            if final:                                             # one gap per request and step
                previous = self.last_output_time.pop(req.request_id, None)
                if previous is not None:
                    self.metrics.itl.observe(now - previous)
                if not req.finished:
                    self.last_output_time[req.request_id] = now
            if req.finished and final:
                del self.sinks[req.request_id]
                self.metrics.finished_request(req)
        push_all(pushes)

    def _watch_prefix(self, req: Request) -> None:
        """Count (and once, log) a prompt whose shared prefix is too short for the prefix cache to reuse."""
        if self.short_prefix is None:
            return
        shared = self.short_prefix.observe(req.prompt_token_ids)
        if shared and req.num_cached_tokens == 0:
            self.metrics.short_prefix.inc()
            if not self.short_prefix_warned:
                self.short_prefix_warned = True
                log.warning("prompts share a %d-token prefix, shorter than one KV block (%d tokens): the prefix "
                            "cache reuses whole blocks, so it cannot hit; a smaller --block-size or a longer "
                            "shared prefix would let it (minillm:prefix_cache_short_shared_prefix counts them)",
                            shared, self.short_prefix.block_size)

    def _snapshot(self) -> dict:
        """Counters published for /debug/engine and /metrics, so that no other thread reads the engine."""
        bm, scheduler, m = self.engine.block_manager, self.engine.scheduler, self.metrics
        m.running.set(len(scheduler.running))
        m.waiting.set(len(scheduler.waiting))     # the inbox is empty here: every add reached the scheduler
        m.kv_free.set(bm.num_free_blocks)
        m.kv_used.set(bm.num_blocks - bm.num_free_blocks)
        m.kv_usage.set(1 - bm.num_free_blocks / bm.num_blocks)
        finished = {reason: m.registry.get_sample_value("vllm:request_success_total", {"finished_reason": reason})
                    for reason in ("stop", "length", "abort", "error")}
        return {"num_free_blocks": bm.num_free_blocks, "num_blocks": bm.num_blocks, "num_requests": len(self.sinks),
                "num_finished": int(finished["stop"] + finished["length"]), "num_aborted": int(finished["abort"]),
                "num_failed": int(finished["error"])}
