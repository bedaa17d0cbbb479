"""The server under faults and limits (issue 17): a request the engine refuses, clients that
hang up early, API keys, size and queue limits, /metrics and /health.

Each test starts its own server (build_app's options differ) on one shared LLM; only one
server runs at a time, so only one engine thread owns the engine.
"""
import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
prometheus_parser = pytest.importorskip("prometheus_client.parser")

from minillm import LLM  # noqa: E402
from minillm.__main__ import build_parser  # noqa: E402
from minillm.serving.server import Job, ServerThread, build_app  # noqa: E402

NUM_KV_BLOCKS = 64
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=256,
               num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=8)


@contextlib.contextmanager
def serving(llm, asgi_spec=None, **options):
    app = build_app(llm, served_model_name="smollm2", **options)

    async def as_spec(scope, receive, send):             # the ASGI spec version another server would declare
        await app({**scope, "asgi": {**scope.get("asgi", {}), "spec_version": asgi_spec}}, receive, send)

    with ServerThread(as_spec if asgi_spec else app) as server:
        yield SimpleNamespace(url=server.url, worker=app.state.server.worker,
                              client=openai.OpenAI(base_url=server.base_url, api_key=options.get("api_key") or "x",
                                                   max_retries=0, timeout=30))


def post(url, path="completions", timeout=30, **body):
    return httpx.post(f"{url}/v1/{path}", json={"model": "smollm2", "prompt": "Hello", "max_tokens": 4, **body},
                      timeout=timeout)


def assert_openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def wait_until_idle(url, timeout_s=3.0) -> dict:
    """/debug/engine once no request is left in the engine (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{url}/debug/engine").json()
        if stats["num_requests"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def wait_until_done(url, num_requests, timeout_s=30.0) -> dict:
    """/debug/engine once num_requests have finished, been aborted or failed (or after timeout_s)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{url}/debug/engine").json()
        if stats["num_finished"] + stats["num_aborted"] + stats["num_failed"] >= num_requests or \
                time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_idle_and_no_block_leaked(url):
    stats = wait_until_idle(url)
    assert stats["num_requests"] == 0, stats
    assert stats["num_free_blocks"] == stats["num_blocks"] == NUM_KV_BLOCKS, stats


def long_request(stream):
    return {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": stream}


# ---- 1. a request the engine refuses at add time -----------------------------------------------

def test_engine_refusing_a_request_fails_only_that_request(llm, monkeypatch):
    add = llm.engine.add_request

    def add_request(req):
        if req.prompt == "refuse me":
            raise ValueError("refused by the engine")
        if req.prompt == "break me":
            raise RuntimeError("engine bug")
        add(req)

    monkeypatch.setattr(llm.engine, "add_request", add_request)
    with serving(llm) as s:
        error = assert_openai_error(post(s.url, prompt="refuse me", timeout=10), 400)
        assert "refused by the engine" in error["message"]
        error = assert_openai_error(post(s.url, prompt="break me", timeout=10), 500)
        assert "engine bug" in error["message"] and error["type"] == "server_error"
        streamed = httpx.post(f"{s.url}/v1/completions", timeout=10,
                              json={"model": "smollm2", "prompt": "refuse me", "stream": True})
        assert "refused by the engine" in streamed.text and streamed.text.endswith("data: [DONE]\n\n")
        assert post(s.url, prompt="Hello", timeout=10).json()["usage"]["completion_tokens"] == 4
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert_idle_and_no_block_leaked(s.url)


# ---- 2. clients that hang up before any output -------------------------------------------------

@pytest.mark.parametrize("asgi_spec", ["2.3", "2.4"])
def test_stream_abandoned_before_its_first_chunk_is_aborted(llm, asgi_spec):
    """uvicorn says ASGI 2.3, for which Starlette cancels a stream whose client left; on 2.4 it
    does not (it waits for a send to fail, and uvicorn's sends to a gone client do not fail)."""
    with serving(llm, asgi_spec=asgi_spec) as s:
        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{s.url}/v1/completions", json=long_request(True)) as response:
                assert response.status_code == 200                  # headers only; hang up before any event
        stats = wait_until_done(s.url, 1)
        assert (stats["num_aborted"], stats["num_finished"]) == (1, 0)      # not decoded on to max_tokens
        assert_idle_and_no_block_leaked(s.url)


def test_job_text_cancelled_aborts_its_request():
    """A non-streaming handler cancelled while it waits (server shutdown, ...) still aborts."""
    aborted = []
    worker = SimpleNamespace(submit=lambda req, sink: None, abort=aborted.append)
    http = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, result=False))

    async def main():
        job = Job(worker, SimpleNamespace(request_id="r1"), "smollm2", "cmpl", http)
        task = asyncio.create_task(job.text())
        await asyncio.sleep(0.05)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert aborted == ["r1"]


# ---- 3. API key --------------------------------------------------------------------------------

def test_api_key_guards_v1_but_not_health_or_metrics(llm):
    with serving(llm, api_key=KEY) as s:
        assert s.client.completions.create(model="smollm2", prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in s.client.models.list().data] == ["smollm2"]
        wrong = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}])
        assert_openai_error(post(s.url), 401)                          # no Authorization header at all
        assert_openai_error(httpx.get(f"{s.url}/v1/models"), 401)
        assert httpx.get(f"{s.url}/health").status_code == 200
        assert httpx.get(f"{s.url}/metrics").status_code == 200


def test_serve_takes_the_api_key_from_the_flag_or_the_environment(monkeypatch):
    for name in ("VLLM_API_KEY", "MINILLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    assert build_parser().parse_args(["serve"]).api_key is None
    assert build_parser().parse_args(["serve", "--api-key", "k1"]).api_key == "k1"
    monkeypatch.setenv("MINILLM_API_KEY", "k2")
    assert build_parser().parse_args(["serve"]).api_key == "k2"
    monkeypatch.setenv("VLLM_API_KEY", "k3")
    assert build_parser().parse_args(["serve"]).api_key == "k3"
    assert build_parser().parse_args(["serve", "--api-key", "k1"]).api_key == "k1"


def test_serve_warms_up_steps_the_engine_on_its_own_thread_and_stops_on_sigterm(monkeypatch):
    """`minillm serve` compiles the engine's step shapes before the port opens, steps the engine on the thread that
    called it (the one that loaded the model: its OpenMP pool, see minillm/engine/worker.py) while HTTP runs on
    another, answers a request, and on SIGTERM drains and returns with its signal handlers restored, no KV block held
    and no prefix cached."""
    import os
    import signal

    from helpers import CharTokenizer
    from minillm.model.llama import random_model, tiny_config
    from minillm.serving import server as server_module

    tiny = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), max_model_len=64,
               enable_prefix_caching=True)
    at_open, step_threads, answers = [], set(), []
    engine_step = tiny.engine.step
    monkeypatch.setattr(tiny.engine, "step", lambda: (step_threads.add(threading.current_thread()), engine_step())[1])

    def client(url):
        answers.append(post(url, prompt=[5, 6, 7], max_tokens=3, temperature=0).json())
        os.kill(os.getpid(), signal.SIGTERM)                     # what an operator's `kill` sends

    start = ServerThread.start

    def start_and_drive(self, *args, **kwargs):                 # serve() starts the HTTP thread, then steps
        at_open.append((tiny.engine.runner.compiled_decode_steps, tiny.engine.runner.compiled_batched_steps))
        started = start(self, *args, **kwargs)
        threading.Thread(target=client, args=(self.url,), daemon=True).start()
        return started

    monkeypatch.setattr(ServerThread, "start", start_and_drive)
    before = signal.getsignal(signal.SIGTERM)
    server_module.serve(tiny, port=0)                           # returns once SIGTERM has shut it down
    assert len(at_open) == 1 and all(count > 0 for count in at_open[0])
    assert step_threads == {threading.current_thread()}
    assert answers[0]["usage"]["completion_tokens"] == 3
    assert signal.getsignal(signal.SIGTERM) is before
    assert not any(t.name == "minillm-http" and t.is_alive() for t in threading.enumerate())
    bm = tiny.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and not tiny.engine.has_unfinished()


def test_serve_passes_its_limit_flags_to_the_app(monkeypatch):
    import minillm
    import minillm.serving.server
    from minillm.__main__ import main

    seen = {}
    monkeypatch.setattr(minillm, "LLM", lambda **kwargs: SimpleNamespace(**kwargs))
    monkeypatch.setattr(minillm.serving.server, "serve", lambda llm, **options: seen.update(options))
    main(["serve", "--max-waiting", "8", "--max-body-bytes", "4096", "--stall-timeout-s", "2.5"])
    assert (seen["max_waiting"], seen["max_body_bytes"], seen["stall_timeout_s"]) == (8, 4096, 2.5)
    seen.clear()
    main(["serve"])                                              # unset: build_app's defaults
    assert not {"max_waiting", "max_body_bytes", "stall_timeout_s"} & set(seen)


def test_serve_quantises_the_model_it_loads_when_asked(monkeypatch):
    import minillm
    import minillm.serving.server
    from minillm.__main__ import main

    made = []
    monkeypatch.setattr(minillm, "LLM", lambda **kwargs: made.append(kwargs) or SimpleNamespace(**kwargs))
    monkeypatch.setattr(minillm.serving.server, "serve", lambda llm, **options: None)
    main(["serve", "--quantization", "w8a8"])
    main(["serve"])
    assert [m["quantization"] for m in made] == ["w8a8", None]


@pytest.mark.parametrize("option, value", [("max_waiting", 0), ("max_body_bytes", -1), ("max_waiting", 2.5),
                                           ("stall_timeout_s", 0.0), ("stall_timeout_s", float("nan"))])
def test_bad_limits_are_refused_when_the_app_is_built(option, value):
    with pytest.raises(ValueError, match=rf"{option} = .* allowed"):
        build_app(None, **{option: value})


# ---- 4. limits ---------------------------------------------------------------------------------

LIMITS = [   # (id, path, body, status, param)
    ("stop-17-strings", "completions", {"stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("stop-string-too-long", "completions", {"stop": ["x" * 300]}, 400, "stop"),
    ("top-logprobs", "chat/completions", {"logprobs": True, "top_logprobs": 5}, 400, None),
    ("best-of-2", "completions", {"best_of": 2}, 400, "best_of"),
    ("n-2", "completions", {"n": 2}, 400, "n"),
    ("max-tokens-past-context", "completions", {"max_tokens": 300}, 400, "prompt"),
    ("negative-max-tokens", "completions", {"max_tokens": -1}, 400, None),
    ("seed-past-64-bits", "completions", {"seed": 10**30, "temperature": 1.0}, 400, None),
]


def test_limits_answer_openai_errors(llm):
    with serving(llm, max_body_bytes=4096) as s:
        for case, path, extra, status, param in LIMITS:
            body = {"model": "smollm2", **({"messages": [{"role": "user", "content": "Hi"}]}
                                          if path.startswith("chat") else {"prompt": "Hi"}), **extra}
            error = assert_openai_error(httpx.post(f"{s.url}/v1/{path}", json=body), status)
            assert param is None or error["param"] == param, case
        big = httpx.post(f"{s.url}/v1/completions", json={"model": "smollm2", "prompt": "word " * 1000})
        assert_openai_error(big, 413)
        chunked = httpx.post(f"{s.url}/v1/completions", content=iter([b'{"model": "smollm2", "prompt": "',
                                                                       b"w" * 5000, b'"}']))
        assert_openai_error(chunked, 413)
        assert post(s.url).status_code == 200                            # still serving


@contextlib.contextmanager
def stalled(llm, monkeypatch):
    """The engine's step blocks until the returned event is set (a stuck forward)."""
    release, step = threading.Event(), llm.engine.step

    def slow_step():
        release.wait(30)
        return step()

    monkeypatch.setattr(llm.engine, "step", slow_step)
    try:
        yield release
    finally:
        release.set()


def test_full_waiting_queue_answers_429(llm, monkeypatch):
    with serving(llm, max_waiting=2) as s, stalled(llm, monkeypatch) as release, ThreadPoolExecutor(2) as pool:
        queued = [pool.submit(post, s.url) for _ in range(2)]
        deadline = time.monotonic() + 5
        while s.worker.num_without_output < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        error = assert_openai_error(post(s.url), 429)
        assert "waiting" in error["message"] and "--max-waiting" in error["message"]
        m = metrics(s.url)           # the gauge the limit applies to, not vllm's scheduler-waiting gauge
        assert m["minillm:num_requests_without_output"] == 2 and m["minillm:requests_rejected_total"] == 1
        release.set()
        assert [f.result(timeout=30).status_code for f in queued] == [200, 200]
        assert post(s.url).status_code == 200
        assert_idle_and_no_block_leaked(s.url)


# ---- 5. /metrics -------------------------------------------------------------------------------

def metrics(url) -> dict:
    """{sample name with sorted labels: value} from the Prometheus text."""
    text = httpx.get(f"{url}/metrics").text
    return {name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items())): value
            for family in prometheus_parser.text_string_to_metric_families(text)
            for name, labels, value, *_ in family.samples}


def test_metrics_count_requests_tokens_and_blocks(llm):
    with serving(llm) as s:
        prompts = ["The capital of France is", "Water boils at", "def f(x):"]
        usages = [s.client.completions.create(model="smollm2", prompt=p, max_tokens=5, temperature=0,
                                              extra_body={"ignore_eos": True}).usage for p in prompts]
        with httpx.Client(timeout=30) as client:                      # one aborted request
            with client.stream("POST", f"{s.url}/v1/completions", json=long_request(True)) as response:
                next(line for line in response.iter_lines() if line)
        assert_idle_and_no_block_leaked(s.url)
        m = metrics(s.url)
        assert m["vllm:request_success_total{finished_reason=length}"] == 3
        assert m["vllm:request_success_total{finished_reason=abort}"] == 1
        assert m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0
        assert m["minillm:kv_blocks_free"] == NUM_KV_BLOCKS and m["minillm:kv_blocks_used"] == 0
        assert m["vllm:kv_cache_usage_perc"] == 0
        long_prompt = len(llm.get_tokenizer().encode(long_request(True)["prompt"]))
        assert m["vllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages) + long_prompt
        assert m["vllm:generation_tokens_total"] >= 15 + 1
        assert m["vllm:prefix_cache_queries_total"] == m["vllm:prompt_tokens_total"]
        assert m["vllm:prefix_cache_hits_total"] == 0 and m["vllm:num_preemptions_total"] == 0
        assert m["vllm:time_to_first_token_seconds_count"] == 4
        assert m["vllm:time_per_output_token_seconds_count"] == 3
        # vLLM's per-request histograms: every started request has a queue and prefill time, every finished one
        # (not the aborted) an end-to-end and decode time; 4 tokens after the first of each finished request
        assert m["vllm:request_queue_time_seconds_count"] == m["vllm:request_prefill_time_seconds_count"] == 4
        assert m["vllm:e2e_request_latency_seconds_count"] == m["vllm:request_decode_time_seconds_count"] == 3
        assert m["vllm:inter_token_latency_seconds_count"] >= 3 * 4
        assert m["vllm:request_prompt_tokens_sum"] == m["vllm:prompt_tokens_total"]
        assert m["vllm:request_generation_tokens_count"] == 3 and m["vllm:request_generation_tokens_sum"] == 15
        e2e, ttft = m["vllm:e2e_request_latency_seconds_sum"], m["vllm:time_to_first_token_seconds_sum"]
        assert 0 < m["vllm:request_queue_time_seconds_sum"] <= ttft and 0 < e2e
    with serving(llm) as fresh:                          # one registry per app: counts start again
        assert metrics(fresh.url)["vllm:prompt_tokens_total"] == 0


def test_metrics_flag_a_shared_prefix_shorter_than_one_kv_block(smollm2_path, caplog):
    """Prompts that share 10 tokens with 16-token blocks: the prefix cache cannot hit, and /metrics says so (once in
    the log too); prompts that share whole blocks hit and are not flagged."""
    llm = LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=256, num_kv_blocks=NUM_KV_BLOCKS,
              max_num_seqs=8, enable_prefix_caching=True, block_size=16)
    system = list(range(1000, 1010))                                     # a 10-token shared "system prompt"
    with serving(llm) as s, caplog.at_level("WARNING", logger="minillm.serving.server"):
        for tail in (range(2000, 2030), range(3000, 3030)):
            s.client.completions.create(model="smollm2", prompt=system + list(tail), max_tokens=2, temperature=0)
        m = metrics(s.url)
        assert m["minillm:prefix_cache_short_shared_prefix_total"] == 1 and m["vllm:prefix_cache_hits_total"] == 0
        assert "10-token prefix, shorter than one KV block (16 tokens)" in caplog.text
        long_system = list(range(4000, 4040))                            # 40 shared tokens: two whole blocks
        for tail in (range(5000, 5010), range(6000, 6010)):
            s.client.completions.create(model="smollm2", prompt=long_system + list(tail), max_tokens=2, temperature=0)
        m = metrics(s.url)
        assert m["minillm:prefix_cache_short_shared_prefix_total"] == 1 and m["vllm:prefix_cache_hits_total"] == 32


# ---- 6. /health --------------------------------------------------------------------------------

@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the death is the point
def test_health_is_503_when_the_engine_thread_dies(llm, monkeypatch):
    with serving(llm) as s:
        assert httpx.get(f"{s.url}/health").status_code == 200
        monkeypatch.setattr(s.worker, "_take_commands", lambda wait: 1 / 0)   # a bug outside any handler
        s.worker.abort("nothing")                                              # wake the thread
        s.worker.thread.join(5)
        assert_openai_error(httpx.get(f"{s.url}/health"), 503)
        monkeypatch.undo()


def test_health_is_503_while_the_engine_is_stuck(llm, monkeypatch):
    with serving(llm, stall_timeout_s=0.5) as s, stalled(llm, monkeypatch) as release, ThreadPoolExecutor(1) as pool:
        queued = pool.submit(post, s.url)
        time.sleep(1.0)
        assert_openai_error(httpx.get(f"{s.url}/health"), 503)
        release.set()
        assert queued.result(timeout=30).status_code == 200
        assert httpx.get(f"{s.url}/health").status_code == 200
