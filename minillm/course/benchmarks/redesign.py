"""Issue 42's guards: this tree against the last commit before the redesign, side by side, one run.

The previous commit is checked out in a git worktree; each tree runs in its own worker process
(redesign_worker.py: minillm imported from that tree), both loaded at once and asked in turn, the
order alternating each round, so that the shared machine's drift hits both sides alike. Per kind
(fp32, bf16, int8, int4: LLM(dtype=..., quantization=...)):
  - one prompt through LLM.generate (48 new tokens, greedy): decode tokens/s after the first token,
    TTFT, and the tokens themselves (fp32: identical, the guard; others: reported);
  - fp32 and bf16 only: 16 prompts decoding together (the median decode-only step, what bench
    engine-step reports) and bench batching's workload shape (12 requests, output tokens/s);
  - perplexity over 4 windows of the evaluation text (equal to within 1e-3 relative);
  - fp32 with n-gram speculation (k = 4 every step), one prompt whose answer is in the prompt: before,
    a lone request speculated on the per-request loop (minillm/speculative/core.py); after, in the engine.
Warm-up: every timed measurement runs once per side before the timed rounds (compiles, page
faults). Rounds per measurement (ROUNDS): 15 for one prompt (a round is a second or a few, and the
shared VM moves single rounds by 10-15%, so 5 rounds left the median a few percent off: two runs of
identical guards differed by 0.03-0.04), 7 for the 16-prompt batch and the n-gram prompt, 3 for the
long workload; 1 for perplexity, which is exact.
A speed ratio is the median over the rounds of after / before within the round (the two sides run
back to back there): the VM drifts within a run, and a ratio of two medians taken over
different rounds carries that drift; a round's own ratio does not. Medians of each side are kept too.
"""
from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

from . import common

NAME = "redesign"
BASELINE = "ca3b9d6"            # the last commit before issue 42 (one forward, one engine)
ROOT = Path(__file__).resolve().parents[3]
WORKER = Path(__file__).with_name("redesign_worker.py")


# The one change the baseline needs to run here at all: on an AVX2-only CPU (the AMD EPYC 7003 VM) its
# engine asked oneDNN to prepack bf16 weights, which oneDNN refuses there (fixed in this tree by
# prepacked.onednn_supports); with it, bf16 weights run unpacked through F.linear, as they do here.
BASELINE_PATCH = """\
--- a/minillm/prepacked.py
+++ b/minillm/prepacked.py
@@ -42,3 +42,5 @@
     if weight.dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
         return found                                   # oneDNN's fp16 GEMM needs AVX-512 FP16 or AVX-NE-CONVERT
+    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
+        return found
     if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available():
"""


def worktree(commit: str) -> Path:
    """The commit checked out (detached) beside this repository with BASELINE_PATCH applied, created
    once and reused."""
    sha = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", commit], text=True).strip()
    path = ROOT.parent / f"minillm-{sha}"
    if not path.exists():
        subprocess.check_call(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha])
    applied = subprocess.run(["git", "-C", str(path), "apply", "--reverse", "--check", "-"], input=BASELINE_PATCH,
                             text=True, capture_output=True).returncode == 0
    if not applied:
        subprocess.run(["git", "-C", str(path), "apply", "-"], input=BASELINE_PATCH, text=True, check=True)
    return path


ROUNDS = {"one_prompt": 15, "copy_prompt": 7, "batch16": 7, "workload": 3, "perplexity": 1}


def measure(workers: dict, kind: str, cmds: dict, rounds: dict) -> list[dict]:
    """Every command of `cmds` once per side untimed, then rounds[name] rounds of each, in turn,
    the side that goes first alternating each round."""
    print(f"redesign: {kind}: {', '.join(cmds)}", file=sys.stderr, flush=True)
    built = {side: w.ask(op="load", kind=kind) for side, w in workers.items()}
    for name, cmd in cmds.items():
        for w in workers.values() if name != "perplexity" else ():    # warm-up (perplexity is not timed)
            w.ask(**cmd)
    answers = {(side, name): [] for side in workers for name in cmds}
    order = list(workers)
    for r in range(max(rounds[name] for name in cmds)):
        for name, cmd in cmds.items():
            if r >= rounds[name]:
                continue
            for side in (order if r % 2 == 0 else order[::-1]):
                answers[side, name].append(workers[side].ask(**cmd))
    rows = [{"kind": kind, "measure": "build", "side": side, "gemm_libraries": built[side]["gemm_libraries"]}
            for side in workers]                # the engine build's tuned GEMM library per shape (None: before)
    for (side, name), runs in answers.items():
        row = {"kind": kind, "measure": name, "side": side}
        for key in runs[0]:
            if key in ("tokens", "build_16bit"):
                row[key] = runs[-1][key]
            else:
                row[key] = statistics.median(run[key] for run in runs)
                row[f"all_{key}"] = [run[key] for run in runs]
        rows.append(row)
    return rows


NEAR_TIE = 0.01        # of the logits' range: the bf16 rounding bound of tests/stages/test_fast_decode.py


def first_difference(workers: dict, kind: str, rows: list[dict]) -> list[dict]:
    """Where one prompt's tokens differ between the sides (bf16: the compiled steps round
    differently), the before side's top-2 logit gap at the first differing token, by its naive
    forward: a near-tie if below NEAR_TIE of the logits' range (tests/stages/test_fast_decode.py bounds the
    compiled step's bf16 rounding by that fraction). Asked while this kind is loaded."""
    by = {r["side"]: r["tokens"] for r in rows if r["kind"] == kind and r["measure"] == "one_prompt"}
    if not by or by["before"] == by["after"]:
        return []
    i = next(i for i, (a, b) in enumerate(zip(by["before"], by["after"])) if a != b)
    gap = workers["before"].ask(op="gap", generated=by["before"][:i])
    return [{"kind": kind, "measure": "first_difference", "side": "before", "position": i, **gap,
             "near_tie": gap["top2_gap"] < NEAR_TIE * gap["logit_range"]}]


def summarise(rows: list[dict]) -> dict:
    by = {(r["kind"], r["measure"], r["side"]): r for r in rows if r["measure"] not in ("first_difference", "build")}
    out = {}
    for (kind, measure, side), after in by.items():
        if side != "after":
            continue
        before = by[kind, measure, "before"]
        key = f"{kind}_{measure}"
        for metric in ("decode_tok_s", "tok_s"):
            if metric in after:
                pairs = zip(after[f"all_{metric}"], before[f"all_{metric}"])
                out[f"{key}_{metric}_ratio"] = statistics.median(a / b for a, b in pairs)
        if "ttft_s" in after:
            out[f"{key}_ttft_ratio"] = after["ttft_s"] / before["ttft_s"]
        if "perplexity" in after:
            out[f"{key}_before"], out[f"{key}_after"] = before["perplexity"], after["perplexity"]
            out[f"{key}_relative_change"] = abs(after["perplexity"] / before["perplexity"] - 1)
        if "tokens" in after:
            out[f"{key}_tokens_identical"] = after["tokens"] == before["tokens"]
    for r in rows:
        if r["measure"] == "first_difference":
            out[f"{r['kind']}_one_prompt_first_difference_near_tie"] = r["near_tie"]
    speed = [v for k, v in out.items() if k.endswith("tok_s_ratio")]
    out["lowest_speed_ratio"] = min(speed)
    out["fp32_tokens_identical"] = all(v for k, v in out.items() if k.startswith("fp32_") and k.endswith("_identical"))
    out["perplexity_unchanged"] = all(v < 1e-3 for k, v in out.items() if k.endswith("_relative_change"))
    return out


def run(quick: bool, baseline: str = BASELINE) -> dict:
    tokens = 16 if quick else 48
    rounds = dict.fromkeys(ROUNDS, 1) if quick else ROUNDS
    kinds = ["fp32"] if quick else ["fp32", "bf16", "int8", "int4", "fp32-ngram"]
    workers = {"before": common.Worker([sys.executable, str(WORKER), str(worktree(baseline))]),
               "after": common.Worker([sys.executable, str(WORKER), str(ROOT)])}
    rows = []
    try:
        for kind in kinds:
            if kind == "fp32-ngram":
                rows += measure(workers, kind, {"copy_prompt": dict(op="one", tokens=tokens, copy=True)}, rounds)
                continue
            cmds = {"one_prompt": dict(op="one", tokens=tokens),
                    "perplexity": dict(op="perplexity", windows=1 if quick else 4)}
            if kind in ("fp32", "bf16"):
                cmds["batch16"] = dict(op="batch", n=4 if quick else 16, tokens=8 if quick else 24)
                cmds["workload"] = dict(op="workload", n=4 if quick else 12)
            rows += measure(workers, kind, cmds, rounds)
            rows += first_difference(workers, kind, rows)
    finally:
        for w in workers.values():
            w.close()
    head = subprocess.check_output(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], text=True).strip()
    config = {"before": baseline, "baseline_patch": BASELINE_PATCH, "after": f"working tree at {head}", "kinds": kinds, "new_tokens": tokens,
              "rounds": rounds, "warm_up": "every timed measurement once per side, untimed",
              "order": "alternating per round", "num_kv_blocks": 1024, "max_num_seqs": 64}
    return common.document(NAME, config, rows, summarise(rows))
