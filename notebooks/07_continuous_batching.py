# %% [markdown]
# # 07 · Continuous batching, chunked prefill, preemption
#
# *Lesson: [lessons/07-continuous-batching.md](../lessons/07-continuous-batching.md).* Interview question:
# **continuous batching 和 static batching 区别？为什么前者吞吐高这么多？**
#
# Set `MINILLM_QUICK=1` for a fast CPU pass (CI does); unset it for the full run.

# %%
import time
import numpy as np
import torch
import matplotlib.pyplot as plt
from minillm import LLM, SamplingParams
from minillm.stages.reference import stream_contiguous
from minillm.engine.outputs import RequestMetrics
from minillm.kvcache.block_manager import BlockManager
from minillm.engine.request import Request
from minillm.engine.scheduler import Scheduler
from minillm.course.notebook import start
from minillm.stages.static_batching import generate_static
from minillm.evaluate import evaluation_text
device, QUICK = start()                        # cuda when present; prints the machine


# %% [markdown]
# ## 1. The scheduler alone (no model)
#
# Each step shares one token budget between decodes (1 token each) and prefill chunks. Watch request 1's prompt
# arrive in two chunks while request 0 already decodes.
#
# By hand first, the whole rule in a few lines of plain Python: running requests go first, oldest first, each taking the
# tokens it still lacks (its prompt, or one token once it decodes); then waiting requests join in arrival
# order while budget is left, a long prompt taking only what is left (a chunk). A request whose tokens
# are all computed samples one more; it leaves after its last one. Change the prompt lengths or the
# budget and re-run both cells.

# %%
def trace_by_hand(prompt_lens, max_tokens, budget):
    reqs = [{"id": i, "tokens": n, "computed": 0, "out": 0} for i, n in enumerate(prompt_lens)]
    waiting, running, trace = list(reqs), [], []
    while waiting or running:
        left, step = budget, []
        for r in running + waiting:                    # running first (oldest first), then arrivals in order
            if left == 0:
                break
            if r in waiting:
                waiting.remove(r); running.append(r)
            n = min(r["tokens"] - r["computed"], left)
            step.append((r["id"], n, r["computed"])); left -= n
        for rid, n, _ in step:                         # after the forward
            r = reqs[rid]; r["computed"] += n
            if r["computed"] == r["tokens"]:           # all its tokens computed: it samples one more
                r["out"] += 1; r["tokens"] += 1
                if r["out"] == max_tokens:
                    running.remove(r)
        trace.append(step)
    return trace

prompt_lens, max_tokens, budget = [40, 100, 20], 3, 96
by_hand = trace_by_hand(prompt_lens, max_tokens, budget)
for i, step in enumerate(by_hand):
    print(f"step {i}: " + ", ".join(f"req {rid}: {n} tok (from {start})" for rid, n, start in step))


# %% [markdown]
# The same three requests through `minillm.engine.scheduler.Scheduler` and its block manager:

# %%
def fake(rid, n, max_tokens=3):
    return Request(str(rid), None, list(range(100, 100 + n)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   None, RequestMetrics(0.0))
sched = Scheduler(BlockManager(64, 16), max_num_batched_tokens=budget)
for rid, n in enumerate(prompt_lens):
    sched.add(fake(rid, n, max_tokens))
library = []
while sched.has_unfinished():
    plan = sched.schedule()
    library.append([(int(r.request_id), n, r.num_computed_tokens) for r, n in zip(plan.requests, plan.num_new_tokens)])
    print(f"step {len(library) - 1}: " + ", ".join(f"req {r.request_id}: {n} tok (from {r.num_computed_tokens})"
                                                   for r, n in zip(plan.requests, plan.num_new_tokens)))
    for r in sched.update(plan):            # what the engine does after the forward
        r.output_token_ids.append(7)
        if len(r.output_token_ids) == r.params.max_tokens:
            r.finish_reason = "length"; sched.finish(r)
print("hand trace vs Scheduler, same schedule:", library == by_hand)

# %% [markdown]
# ![Static vs continuous batching of the same eight requests, one column per forward pass](../lessons/figures/batching_gantt.png)
#
# *Drawn from a real scheduler trace: static batching keeps computing rows of finished requests until the longest one ends, continuous batching lets new requests take their place at the next step.*

# %% [markdown]
# ## 2. The engine on SmolLM2, and the same tokens as one at a time

# %%
def make_workload(tok, n, prompt_range, output_range, seed=0):
    """n chat prompts cut from Python's docs, lengths and output lengths log-uniform in their ranges."""
    rng, body = np.random.default_rng(seed), tok.encode(evaluation_text())
    head = tok.encode("<|im_start|>user\nSummarise this passage:\n")
    tail = tok.encode("<|im_end|>\n<|im_start|>assistant\n")
    prompts, outputs = [], []
    for _ in range(n):
        length = int(np.exp(rng.uniform(*np.log(prompt_range))))
        start = int(rng.integers(0, len(body) - length))
        prompts.append(head + body[start:start + max(1, length - len(head) - len(tail))] + tail)
        outputs.append(int(np.exp(rng.uniform(*np.log(output_range)))))
    return prompts, outputs

def run_engine(llm, prompts, outputs):
    """Every request submitted at once through LLM.generate; the engine's step log records each step's plan."""
    llm.engine.step_log.clear()
    t0 = time.perf_counter()
    done = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in outputs], use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = list(llm.engine.step_log)
    return {"wall": wall, "t0": t0, "steps": steps, "tokens": [o.outputs[0].token_ids for o in done],
            "ttft": [o.metrics.time_to_first_token for o in done], "preempted": sum(s["num_preempted"] for s in steps)}

n, prange, orange = (6, (64, 160), (4, 16)) if QUICK else ((64 if device == "cuda" else 16), (64, 512), (16, 128))
llm = LLM(model="smollm2", dtype="float32", device=device, max_num_batched_tokens=256)
prompts, outputs = make_workload(llm.get_tokenizer(), n, prange, orange)
r = run_engine(llm, prompts, outputs)
alone = []
for p, m in zip(prompts[:3], outputs[:3]):
    (req,) = llm.make_requests([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    for _ in stream_contiguous(llm, req):      # alone on the contiguous cache (minillm/stages/reference.py)
        pass
    alone.append(req.output_token_ids)
print("first three requests identical to running alone:", alone == r["tokens"][:3])
print(f"{sum(outputs)} output tokens in {r['wall']:.1f} s = {sum(outputs)/r['wall']:.1f} tok/s, {len(r['steps'])} steps")
steps = r["steps"]
t = [s["time"] - r["t0"] for s in steps]
fig, ax = plt.subplots(2, 1, figsize=(7, 4), sharex=True)
ax[0].plot(t, [s["num_running"] for s in steps], label="running"); ax[0].plot(t, [s["num_waiting"] for s in steps], label="waiting"); ax[0].legend()
ax[1].plot(t, [s["num_decodes"] for s in steps], ".", label="decode tokens")
ax[1].plot(t, [s["num_tokens"] - s["num_decodes"] for s in steps], ".", label="prefill tokens"); ax[1].set_yscale("symlog"); ax[1].legend()
ax[1].set_xlabel("seconds"); plt.tight_layout(); plt.show()

# %% [markdown]
# ## 3. Static vs continuous batching, side by side
#
# Static batching pads a batch and runs it until its longest request is done; continuous batching lets requests
# leave and join every step.

# %%
t0 = time.perf_counter()
static = generate_static(llm.model, prompts, outputs, batch_size=8)
static_wall = time.perf_counter() - t0
cont = run_engine(llm, prompts, outputs)
print(f"{'static (batches of 8)':22s} {sum(outputs)/static_wall:7.1f} output tok/s   "
      f"TTFT p50 {np.median([t - t0 for t in static['first_token_time']]):6.2f} s")
print(f"{'continuous':22s} {sum(outputs)/cont['wall']:7.1f} output tok/s   TTFT p50 {np.median(cont['ttft']):6.2f} s")
print(f"static batching computed {1 - static['useful_tokens'] / static['computed_tokens']:.0%} of its rows for "
      f"requests that were already done")
print("same tokens:", static["token_ids"] == cont["tokens"])

# %% [markdown]
# ## 4. Preemption: a KV pool too small for everyone
#
# With fewer blocks than the running requests need, the newest request gives its blocks back and recomputes later.
# The outputs do not change.

# %%
max_len, blocks = (512, 32) if QUICK else (1024, 64)     # room for one longest request, not for all
small = LLM(model=llm.model, tokenizer=llm.get_tokenizer(), device=device, max_model_len=max_len, num_kv_blocks=blocks)
s = run_engine(small, prompts, outputs)
print(f"preemptions: {s['preempted']}, tokens identical: {s['tokens'] == cont['tokens']}")

# %% [markdown]
# ## 5. A step of a few rows: every row a query of its own
#
# One request verifying drafts, or a few requests decoding, is a step of 2 to 8 new tokens. It reads every weight
# once whatever the rows, so it should cost about one row. The small step runs it through one compiled function per
# layer, each row attending up to its own position (`row_lens`), with a kernel that reads each block of weights once
# for all the rows (`minillm/model/cpu_gemm.c`); the batched step (library GEMMs, attention outside the graph) is how
# these steps ran before (`runner.small_step_rows = 1` sends them there). Below: one request's last n cached
# positions computed again as one run of n rows, both ways, live; then the committed `bench small-step` run.

# %%
import json
from pathlib import Path
from minillm.model.runner import build_batch

engine, runner = llm.engine, llm.engine.runner
(req,) = llm.make_requests([{"prompt_token_ids": prompts[0]}],
                           SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True))
engine.add_request(req)
for _ in range(3):
    engine.step()                                       # the prompt, then two decode steps
bm = engine.block_manager

def run_of(n):
    """The request's last n cached positions as one run (their slots exist; the K/V written is what is there)."""
    start = req.num_computed_tokens - n
    run = (req.all_token_ids[start:start + n], start, bm.block_table(req.request_id),
           bm.slot_mapping(req.request_id, start, start + n))
    return build_batch([run], ["all"], bm.block_size, engine.kv.k.device, engine.decode_group_cost)

def timed(batch, repeats=2 if QUICK else 10):
    runner.forward(batch)                               # warm-up
    t0 = time.perf_counter()
    for _ in range(repeats):
        logits = runner.forward(batch)
    return 1000 * (time.perf_counter() - t0) / repeats, logits

rows_small = runner.small_step_rows
if rows_small == 1:
    print(f"no few-row kernel here ({runner.compile_failed or 'see model/cpu_gemm.py'}): every step of 2+ rows is batched")
with torch.no_grad():
    for n in (1, 2, 4, 8):
        batch = run_of(n)
        small_ms, small = timed(batch)
        runner.small_step_rows = 1                      # the batched step
        batched_ms, batched = timed(batch)
        runner.small_step_rows = rows_small
        print(f"{n} row(s): small step {small_ms:5.1f} ms, batched step {batched_ms:5.1f} ms; "
              f"max |logit difference| = {(small - batched).abs().max().item():.1e}")
engine.abort_request(req.request_id)

path = Path("../results/small-step-amd.json")
if path.exists():
    print("committed bench small-step run (AMD EPYC VM), ms per step, small / batched:")
    for r in json.loads(path.read_text())["results"]:
        print(f"  {r['dtype']:>8} {r['shape']:>12}: {r['small_ms']:5.1f} / {r['batched_ms']:5.1f} "
              f"(step / one row: {r['small_vs_one_row']:.2f} / {r['batched_vs_one_row']:.2f})")
