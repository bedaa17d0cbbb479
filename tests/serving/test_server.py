"""The OpenAI-compatible server, driven by the official openai client against the real model.

The reference is offline LLM.generate / LLM.chat on the same LLM, run before the server's
engine thread takes the engine over: at temperature 0 every served request, concurrent or
not, streamed or not, must return the same text. Errors must come back as OpenAI-style 4xx
bodies with the server still serving, and no KV block may outlive its request.
"""
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from minillm import LLM, SamplingParams  # noqa: E402
from minillm.serving.server import ServerThread, build_app  # noqa: E402

MAX_TOKENS = 12
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 128
COMPLETION_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
                      "The three primary colours are", "Once upon a time, in a small village,",
                      "import numpy as np\n", "The opposite of hot is", "My favourite book is"]
CHAT_QUESTIONS = ["What is a KV cache?", "Name a prime number.", "Say hello in French.", "What is 2 + 2?",
                  "Give me a tip for readable code.", "What colour is the sky?", "Who wrote Hamlet?",
                  "What is Python?"]


def as_chat(question):
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
               num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=16)


@pytest.fixture(scope="module")
def offline(llm):
    """Offline outputs, computed before `served` hands the engine to the server's thread."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SimpleNamespace(completions=llm.generate(COMPLETION_PROMPTS, params, use_tqdm=False),
                           chats=llm.chat([as_chat(q) for q in CHAT_QUESTIONS], params, use_tqdm=False))


@pytest.fixture(scope="module")
def served(llm, offline):
    with ServerThread(build_app(llm, served_model_name="smollm2")) as server:
        yield SimpleNamespace(server=server, url=server.url,
                              client=openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0))


# ---- helpers ------------------------------------------------------------------------------

def complete(client, prompt, stream, **kwargs) -> dict:
    """One /v1/completions call; the text, finish_reason and usage whether streamed or not."""
    if not stream:
        r = client.completions.create(model="smollm2", prompt=prompt, **kwargs)
        return {"text": r.choices[0].text, "finish_reason": r.choices[0].finish_reason, "usage": r.usage}
    out = {"text": "", "finish_reason": None, "usage": None}
    for chunk in client.completions.create(model="smollm2", prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            out["text"] += choice.text
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
        out["usage"] = chunk.usage or out["usage"]
    return out


def chat(client, question, stream, **kwargs) -> dict:
    if not stream:
        r = client.chat.completions.create(model="smollm2", messages=as_chat(question), **kwargs)
        return {"text": r.choices[0].message.content, "finish_reason": r.choices[0].finish_reason, "usage": r.usage}
    out = {"text": "", "finish_reason": None, "usage": None}
    for chunk in client.chat.completions.create(model="smollm2", messages=as_chat(question), stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            out["text"] += choice.delta.content or ""
            out["finish_reason"] = choice.finish_reason or out["finish_reason"]
        out["usage"] = chunk.usage or out["usage"]
    return out


def engine_stats(url) -> dict:
    return httpx.get(f"{url}/debug/engine").json()


def wait_until_idle(url, timeout_s=20.0) -> dict:
    """The engine thread publishes its counters after each step: poll until no request is left."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(url)
        if stats["num_requests"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_no_block_leaked(url):
    stats = wait_until_idle(url)
    assert stats["num_requests"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"] == NUM_KV_BLOCKS


def assert_openai_error(response, status):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# ---- tests --------------------------------------------------------------------------------

def test_models_lists_the_served_model(served):
    (model,) = served.client.models.list().data
    assert model.id == "smollm2" and model.owned_by == "minillm"


def test_16_concurrent_requests_equal_offline_generate(served, offline, llm):
    """Completions and chats, streamed and not, all in flight together on one engine."""
    jobs = []
    for i in range(8):
        jobs.append((complete, COMPLETION_PROMPTS[i], i % 2 == 1, offline.completions[i]))
        jobs.append((chat, CHAT_QUESTIONS[i], i % 2 == 0, offline.chats[i]))
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    first_step = len(llm.engine.step_log)        # the engine thread appends; this thread only reads
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(call, served.client, prompt, stream, **kwargs) for call, prompt, stream, _ in jobs]
        results = [f.result(timeout=120) for f in futures]
    for (_, prompt, stream, expected), got in zip(jobs, results):
        out = expected.outputs[0]
        assert got["text"] == out.text, (prompt, stream)
        assert got["finish_reason"] == out.finish_reason == "length"
        prompt_tokens = len(expected.prompt_token_ids)
        assert (got["usage"].prompt_tokens, got["usage"].completion_tokens, got["usage"].total_tokens) == \
               (prompt_tokens, MAX_TOKENS, prompt_tokens + MAX_TOKENS)
    assert max(step["num_seqs"] for step in llm.engine.step_log[first_step:]) > 1     # they shared batches
    assert_no_block_leaked(served.url)


def test_sampling_parameters_reach_the_engine(served):
    stopped = complete(served.client, "Count: 1, 2, 3,", stream=True, max_tokens=MAX_TOKENS, temperature=0, stop=[","])
    assert stopped["finish_reason"] == "stop" and "," not in stopped["text"]
    seeded = [chat(served.client, "Write a word.", stream=False, max_completion_tokens=8, temperature=1.0, top_p=0.9,
                   seed=7, extra_body={"top_k": 20})["text"] for _ in range(2)]
    assert seeded[0] == seeded[1]


BAD_REQUESTS = [   # (id, path, JSON body or raw bytes, status, param)
    ("malformed-json", "completions", b'{"model": "smollm2", "prompt": ', 400, None),
    ("not-an-object", "completions", b"[1, 2]", 400, None),
    ("missing-model", "completions", {"prompt": "hi"}, 400, "model"),
    ("unknown-model", "completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("unknown-model-chat", "chat/completions", {"model": "gpt-9", "messages": as_chat("hi")}, 404, "model"),
    ("negative-temperature", "completions", {"model": "smollm2", "prompt": "hi", "temperature": -1}, 400, None),
    ("temperature-not-a-number", "completions", {"model": "smollm2", "prompt": "hi", "temperature": "hot"},
     400, "temperature"),
    ("top-p-zero", "completions", {"model": "smollm2", "prompt": "hi", "top_p": 0}, 400, None),
    ("max-tokens-zero", "chat/completions", {"model": "smollm2", "messages": as_chat("hi"), "max_tokens": 0},
     400, None),
    ("n-2", "chat/completions", {"model": "smollm2", "messages": as_chat("hi"), "n": 2}, 400, "n"),
    ("empty-stop", "completions", {"model": "smollm2", "prompt": "hi", "stop": [""]}, 400, None),
    ("two-prompts", "completions", {"model": "smollm2", "prompt": ["a", "b"]}, 400, "prompt"),
    ("prompt-too-long", "completions", {"model": "smollm2", "prompt": "word " * 400}, 400, "prompt"),
    ("prompt-plus-max-tokens-too-long", "completions",
     {"model": "smollm2", "prompt": "word " * 200, "max_tokens": 100}, 400, "prompt"),
    ("chat-too-long", "chat/completions", {"model": "smollm2", "messages": as_chat("word " * 400)}, 400, "messages"),
    ("bad-role", "chat/completions", {"model": "smollm2", "messages": [{"role": "wizard", "content": "hi"}]},
     400, "messages"),
    ("no-messages", "chat/completions", {"model": "smollm2", "messages": []}, 400, "messages"),
]


@pytest.mark.parametrize("path, body, status, param", [case[1:] for case in BAD_REQUESTS],
                         ids=[case[0] for case in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error_body(served, path, body, status, param):
    url = f"{served.url}/v1/{path}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    error = assert_openai_error(response, status)
    assert error["param"] == param
    assert error["code"] == {404: "model_not_found"}.get(status, error["code"])


def test_errors_reach_the_openai_client_and_the_server_keeps_serving(served):
    with pytest.raises(openai.NotFoundError):
        served.client.completions.create(model="gpt-9", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="context length"):
        served.client.completions.create(model="smollm2", prompt="word " * 400)
    assert_openai_error(httpx.get(f"{served.url}/v1/nothing-here"), 404)
    ok = chat(served.client, "Say hi.", stream=True, max_tokens=4, temperature=0)
    assert ok["finish_reason"] in ("stop", "length") and ok["usage"].completion_tokens >= 1
    assert_no_block_leaked(served.url)


def long_request(stream):
    return {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def test_client_disconnecting_mid_stream_aborts_its_request(served):
    before = engine_stats(served.url)["num_aborted"]
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", f"{served.url}/v1/completions", json=long_request(True)) as response:
            assert response.status_code == 200
            lines = (line for line in response.iter_lines() if line)        # events are blank-line separated
            assert all(next(lines).startswith("data: ") for _ in range(2))     # two tokens, then hang up
    assert_no_block_leaked(served.url)
    assert engine_stats(served.url)["num_aborted"] == before + 1


def test_client_giving_up_on_a_non_streaming_request_aborts_it(served):
    before = engine_stats(served.url)["num_aborted"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{served.url}/v1/completions", json=long_request(False), timeout=1.0)
    assert_no_block_leaked(served.url)
    assert engine_stats(served.url)["num_aborted"] == before + 1


def test_speculative_server_equals_offline_and_reports_drafts(smollm2_path, offline):
    """`serve --speculative-method ngram`: drafts verified inside the server's batches, the same text
    as the plain engine, vLLM's spec_decode counters in /metrics, and no block left behind."""
    spec = LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
               num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=16, speculative_method="ngram", num_speculative_tokens=4,
               speculative_policy="always")
    kwargs = {"max_tokens": MAX_TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with ServerThread(build_app(spec, served_model_name="smollm2")) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(complete, client, p, i % 2 == 0, **kwargs) for i, p in enumerate(COMPLETION_PROMPTS)]
            results = [f.result(timeout=120) for f in futures]
        assert [r["text"] for r in results] == [o.outputs[0].text for o in offline.completions]
        assert all(r["finish_reason"] == "length" for r in results)
        assert_no_block_leaked(server.url)
        lines = httpx.get(server.url + "/metrics").text.splitlines()
        metrics = {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("vllm:spec_decode")}
    assert metrics["vllm:spec_decode_num_draft_tokens_total"] == spec.engine.speculation.drafted > 0
    assert metrics["vllm:spec_decode_num_accepted_tokens_total"] == spec.engine.speculation.accepted > 0
    by_position = [metrics[f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{j}"}}'] for j in range(4)]
    assert sum(by_position) == spec.engine.speculation.accepted
    assert by_position == sorted(by_position, reverse=True) and by_position[0] > 0   # draft j needs drafts < j
