# %% [markdown]
# # 09 · Serving: an OpenAI-compatible server on the engine
#
# *Lesson: [lessons/09-serving.md](../lessons/09-serving.md).* The article's 实战 section deploys a model
# with vLLM's OpenAI-compatible server and calls it with the OpenAI Python SDK (**零代码切换**). Here
# minillm's own server (`minillm/serving/server.py`) plays vLLM's part: same endpoints, same client code.
#
# It runs in a background thread of this notebook; from a shell it is
# `python -m minillm serve --model smollm2 --port 8000`.
#
# `MINILLM_QUICK=1` shrinks the load test (CI does); unset it for the full run.

# %%
import time
from concurrent.futures import ThreadPoolExecutor
import httpx
import matplotlib.pyplot as plt
import numpy as np
import openai
from minillm import LLM
from minillm.serving.server import ServerThread, build_app
from minillm.course.notebook import start

device, QUICK = start()                        # cuda when present; prints the machine
llm = LLM(model="smollm2", dtype="float32", device=device, max_num_seqs=32)
server = ServerThread(build_app(llm, served_model_name="smollm2")).start()    # a free port on 127.0.0.1
print("serving at", server.base_url)

# %% [markdown]
# ## 1. The OpenAI client, unchanged
#
# The client only needs a base URL. `api_key` is required by the SDK but ignored by the server.
#
# Underneath, a request is a JSON body POSTed to `/v1/chat/completions`, and the answer is a JSON object
# with `choices[0].message.content` and `usage`. Written by hand with plain HTTP first, then through the
# SDK: at temperature 0 both must carry the same text.

# %%
body = {"model": "smollm2", "messages": [{"role": "user", "content": "Give me three tips for readable code."}],
        "max_tokens": 48, "temperature": 0}
by_hand = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120).json()
print("response keys:", sorted(by_hand), "| object:", by_hand["object"])
print("choice keys:", sorted(by_hand["choices"][0]), "| usage:", by_hand["usage"])

# %%
client = openai.OpenAI(base_url=server.base_url, api_key="unused")
print([m.id for m in client.models.list().data])
reply = client.chat.completions.create(
    model="smollm2", messages=[{"role": "user", "content": "Give me three tips for readable code."}],
    max_tokens=48, temperature=0)
print(reply.choices[0].message.content)
print(reply.usage)
print("SDK vs hand-made request, same text:", reply.choices[0].message.content == by_hand["choices"][0]["message"]["content"])

# %% [markdown]
# ## 2. Streaming: server-sent events, one chunk per token
#
# With `stream=True` the server answers with `text/event-stream`: a `data: {...}` line per new piece of
# text and `data: [DONE]` at the end. The first chunk's arrival is the time to first token (TTFT) a user
# feels; the gaps after it are the time per output token (TPOT).

# %%
start = time.perf_counter()
arrivals = []
for chunk in client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        max_tokens=32, temperature=0, stream=True):
    piece = chunk.choices[0].delta.content
    if piece:
        arrivals.append(time.perf_counter() - start)
        print(piece, end="", flush=True)
print(f"\n\nTTFT {arrivals[0]*1e3:.0f} ms, mean gap after it {1e3*(arrivals[-1]-arrivals[0])/max(1, len(arrivals)-1):.0f} ms")

# %% [markdown]
# What travels on the wire (the same request through plain HTTP), parsed by hand: every non-empty line
# is `data: ` followed by one JSON chunk, until `data: [DONE]`. Joined, the chunks' texts must be the text
# of the same request sent without `stream`.

# %%
import json
body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0, "stream": True}
pieces = []
with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
    for line in response.iter_lines():
        if line:
            print(line)
        if line.startswith("data: ") and line != "data: [DONE]":
            pieces.append(json.loads(line[len("data: "):])["choices"][0]["text"])
whole = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=120).json()
print("joined chunks:", repr("".join(pieces)), "| one response vs joined chunks, same text:",
      "".join(pieces) == whole["choices"][0]["text"])


# %% [markdown]
# ## 3. minillm or vLLM: only the base URL changes
#
# vLLM's server speaks the same protocol. Start it with
#
# ```bash
# vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8000 \
#     --max-num-seqs 64 --max-num-batched-tokens 2048 --gpu-memory-utilization 0.9 --enable-prefix-caching
# ```
#
# and the function below talks to it by passing `"http://localhost:8000/v1"` and that model name. Nothing
# else in the client changes. (There is no vLLM server here, so only minillm's is called.)

# %%
def ask(base_url, model, question, max_tokens=32):
    client = openai.OpenAI(base_url=base_url, api_key="unused")
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": question}],
                                           max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content

print(ask(server.base_url, "smollm2", "What is a KV cache?"))
# print(ask("http://localhost:8000/v1", "HuggingFaceTB/SmolLM2-135M-Instruct", "What is a KV cache?"))   # vLLM

# %% [markdown]
# ## 4. Many clients, one engine
#
# Every HTTP request becomes a `Request` handed to the one thread that owns the engine; the scheduler
# admits it at the next step. Eight clients at once therefore share batches, exactly like offline
# `llm.generate` with eight prompts. `/debug/engine` shows the KV pool from the engine thread's side.

# %%
first_step = len(llm.engine.step_log)
questions = [f"Name {n} animals." for n in range(2, 10)]
with ThreadPoolExecutor(len(questions)) as pool:
    answers = list(pool.map(lambda q: ask(server.base_url, "smollm2", q, max_tokens=16), questions))
steps = llm.engine.step_log[first_step:]
print("requests per engine step:", [s["num_seqs"] for s in steps])
print(httpx.get(f"{server.url}/debug/engine").json())

# %% [markdown]
# ## 5. A client that hangs up frees its KV blocks
#
# When a streaming client disconnects, the handler's stream is cancelled and it sends an abort to the
# engine thread, which drops the request from the batch and returns its blocks to the pool.

# %%
body = {"model": "smollm2", "prompt": "Tell me a long story.", "max_tokens": 500, "temperature": 0,
        "ignore_eos": True, "stream": True}
with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
    events = (line for line in response.iter_lines() if line)
    print([next(events)[:60] for _ in range(3)], "... hanging up")
stats = httpx.get(f"{server.url}/debug/engine").json()
while stats["num_requests"]:                      # the abort reaches the engine thread within a step
    time.sleep(0.05)
    stats = httpx.get(f"{server.url}/debug/engine").json()
print(stats)

# %% [markdown]
# ## 6. Load test: what the request rate does to throughput and latency
#
# Poisson arrivals at several rates, streamed chat requests of a fixed length (`ignore_eos`), TTFT and TPOT
# measured by the client below (the full run, with hostile traffic too, is
# `python -m minillm bench serve --json results/serve.json`). More load means bigger batches and more
# tokens/s, until the engine saturates: then requests queue and TTFT climbs.

# %%
QUESTIONS = ["What is a KV cache?", "Explain continuous batching in two sentences.", "Write a haiku about the sea.",
             "Give me three tips for readable Python code.", "What is the difference between a list and a tuple?",
             "Why is the sky blue?", "Summarise the plot of Hamlet.", "What does an operating system do?"]

def timed_chat(question, max_tokens, send_at, start):
    """One streamed chat request sent at start + send_at; the client's clock at sending and at each content chunk."""
    time.sleep(max(0.0, start + send_at - time.perf_counter()))
    sent, chunks, usage = time.perf_counter(), [], None
    for chunk in client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": question}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            chunks.append(time.perf_counter())
        usage = chunk.usage or usage
    n = usage.completion_tokens
    return {"sent": sent, "last": chunks[-1], "tokens": n, "ttft": chunks[0] - sent,
            "tpot": (chunks[-1] - chunks[0]) / (n - 1)}

def load_test(rate, num_requests, max_tokens):
    """Open loop: request i leaves at its Poisson arrival time (exponential gaps, mean 1 / rate), whether or not
    the earlier ones have finished."""
    gaps = np.random.default_rng(0).exponential(1.0 / rate, num_requests)
    start = time.perf_counter()
    with ThreadPoolExecutor(num_requests) as pool:
        done = list(pool.map(lambda i: timed_chat(QUESTIONS[i % len(QUESTIONS)], max_tokens, gaps[:i].sum(), start),
                             range(num_requests)))
    wall = max(d["last"] for d in done) - min(d["sent"] for d in done)
    ttft, tpot = [d["ttft"] for d in done], [d["tpot"] for d in done]
    return {"rate": rate, "tok_s": sum(d["tokens"] for d in done) / wall,
            "ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
            "tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99)}

rates = [1.0, 4.0] if QUICK else [0.5, 1.0, 2.0, 4.0]
num_requests, max_tokens = (4, 8) if QUICK else (16, 32)
rows = [load_test(rate, num_requests, max_tokens) for rate in rates]
for r in rows:
    print(f"{r['rate']:4g} req/s: {r['tok_s']:6.1f} tok/s   TTFT p50 {r['ttft_p50']:.2f} s  p99 {r['ttft_p99']:.2f} s   "
          f"TPOT p50 {1e3 * r['tpot_p50']:.0f} ms  p99 {1e3 * r['tpot_p99']:.0f} ms")
fig, (a, b, c) = plt.subplots(1, 3, figsize=(11, 3.3))
a.plot(rates, [r["tok_s"] for r in rows], "o-"); a.set_ylabel("output tokens/s")
for key in ("ttft_p50", "ttft_p99"):
    b.plot(rates, [r[key] for r in rows], "o-", label=key[-3:])
for key in ("tpot_p50", "tpot_p99"):
    c.plot(rates, [1e3 * r[key] for r in rows], "o-", label=key[-3:])
b.set_ylabel("TTFT (s)"); c.set_ylabel("TPOT (ms)"); b.legend(); c.legend()
for ax in (a, b, c):
    ax.set_xscale("log", base=2); ax.set_xticks(rates, [f"{r:g}" for r in rates]); ax.set_xlabel("offered load (requests/s)")
fig.tight_layout(); plt.show()

# %%
server.stop()
