CELLS = [
("md", r"""
# 07 · Continuous batching, chunked prefill, preemption

*Lesson: [lessons/07-continuous-batching.md](../lessons/07-continuous-batching.md).* Interview question:
**continuous batching 和 static batching 区别？为什么前者吞吐高这么多？**

Set `MINILLM_QUICK=1` for a fast CPU pass (CI does); unset it for the full run.
"""),
("code", r"""
import os, time
import numpy as np
import torch
import matplotlib.pyplot as plt
from minillm import LLM, SamplingParams
from minillm.outputs import RequestMetrics
from minillm.block_manager import BlockManager
from minillm.request import Request
from minillm.scheduler import Scheduler
from minillm.benchmarks.common import machine_info
from minillm.benchmarks import batching as bb
QUICK = os.environ.get("MINILLM_QUICK", "0") not in ("", "0")
device = "cuda" if torch.cuda.is_available() else "cpu"
print(machine_info(), "| quick mode" if QUICK else "")
"""),
("md", r"""
## 1. The scheduler alone (no model)

Each step shares one token budget between decodes (1 token each) and prefill chunks. Watch request 1's prompt
arrive in two chunks while request 0 already decodes.
"""),
("code", r"""
def fake(rid, n, max_tokens=3):
    return Request(str(rid), None, list(range(100, 100 + n)), SamplingParams(temperature=0, max_tokens=max_tokens),
                   None, RequestMetrics(0.0))
sched = Scheduler(BlockManager(64, 16), max_num_batched_tokens=96)
for rid, n in enumerate([40, 100, 20]):
    sched.add(fake(rid, n))
step = 0
while sched.has_unfinished():
    plan = sched.schedule()
    print(f"step {step}: " + ", ".join(f"req {r.request_id}: {n} tok (from {r.num_computed_tokens})"
                                       for r, n in zip(plan.requests, plan.num_new_tokens)))
    for r in sched.update(plan):            # what the engine does after the forward
        r.output_token_ids.append(7)
        if len(r.output_token_ids) == r.params.max_tokens:
            r.finish_reason = "length"; sched.finish(r)
    step += 1
"""),
("md", r"""
## 2. The engine on SmolLM2, and the same tokens as one at a time
"""),
("code", r"""
n, prange, orange = (6, (64, 160), (4, 16)) if QUICK else (16, (64, 512), (16, 128))
llm = LLM(model="smollm2", dtype="float32", device=device, max_num_batched_tokens=256)
prompts, outputs = bb.make_workload(llm.get_tokenizer(), n, prange, orange)
r = bb.run_engine(llm, prompts, outputs)
alone = []
for p, m in zip(prompts[:3], outputs[:3]):
    (req,) = llm.make_requests([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))
    for _ in llm.stream_request(req):
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
"""),
("md", r"""
## 3. Static vs continuous batching, side by side

Static batching pads a batch and runs it until its longest request is done; continuous batching lets requests
leave and join every step.
"""),
("code", r"""
static = bb.run_static(llm.model, prompts, outputs, batch_size=8)
cont = bb.run_engine(llm, prompts, outputs)
for name, res in (("static (batches of 8)", static), ("continuous", cont)):
    print(f"{name:22s} {sum(outputs)/res['wall']:7.1f} output tok/s   TTFT p50 {np.median(res['ttft']):6.2f} s")
print(f"static batching computed {static['waste']:.0%} of its rows for requests that were already done")
print("same tokens:", static["tokens"] == cont["tokens"])
"""),
("md", r"""
## 4. Preemption: a KV pool too small for everyone

With fewer blocks than the running requests need, the newest request gives its blocks back and recomputes later.
The outputs do not change.
"""),
("code", r"""
max_len, blocks = (512, 32) if QUICK else (1024, 64)     # room for one longest request, not for all
small = LLM(model=llm.model, tokenizer=llm.get_tokenizer(), device=device, max_model_len=max_len, num_kv_blocks=blocks)
s = bb.run_engine(small, prompts, outputs)
print(f"preemptions: {s['preempted']}, tokens identical: {s['tokens'] == cont['tokens']}")
"""),
]
