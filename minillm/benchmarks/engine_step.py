"""The engine's step against transformers' at the SAME batch: equal requests, no padding, no scheduling.

    python -m minillm bench engine-step [--quick] [--json results/engine-step.json]

Continuous batching beats a padded batch by scheduling (bench batching); this benchmark takes
scheduling away to ask whether one engine step is itself fast. B requests with the same 16-token
prompt and B x new_tokens greedy tokens each (ignore_eos), through

    engine            LLM.generate: the batching engine, weights prepacked (minillm/prepacked.py)
    engine_unpacked   the same engine with plain F.linear (what prepacking buys)
    hf_batched        transformers' generate on the same B prompts as one batch (dense weights,
                      same dtype, KV cache on); equal lengths, so no padding

in fp32 and bf16, B = 16 and 48; the three run in turn in every round (interleaved), medians over
rounds after a warm-up. Output tokens per second of wall time, prompt included.

The roofline of a decode step at batch B reads every weight once and does 2 FLOPs per weight per
row: step time >= max(weight bytes / bandwidth, 2 * params * B / GEMM rate), both rates measured
in this run in the same dtype (the bandwidth by roofline.BandwidthProbe, sampled after every timed
run, the fastest sample kept: it moves on a VM; the GEMM rate is the fastest of torch's
a @ b and each prepacking library's GEMM on a square 2048 matrix, all recorded:
roofline.measure_gemm_rates, and
machine_rates.<dtype>.gemm_GFLOPs_by_route). The libraries prepacking chose per weight
shape are recorded (summary.prepacked_libraries), and so is why the engine attends in fp32 on CPU:
one bf16 decode-group attention by torch's bf16 SDPA kernel against the engine's fp32 one on upcast
copies (summary.bf16_decode_attention).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from .. import prepacked, roofline
from . import common
from .kv_cache import dense_hf_model

NAME = "engine-step"
SYSTEMS = ("engine", "engine_unpacked", "hf_batched")


def settings(quick: bool) -> dict:
    if quick:
        return dict(batches=(4,), dtypes=("float32",), new_tokens=4, rounds=2, prompt_tokens=8)
    return dict(batches=(16, 48), dtypes=("float32", "bfloat16"), new_tokens=32, rounds=3, prompt_tokens=16)


def step_roofline(cfg, dtype: torch.dtype, batch: int, bandwidth: float, gemm_rate: float) -> dict:
    """Lower bound on one decode step's time at `batch` rows: weights read once, 2 FLOPs per weight and row."""
    elem = torch.tensor([], dtype=dtype).element_size()
    read_s = roofline.weight_bytes(cfg, elem) / bandwidth
    gemm_s = 2 * cfg.num_parameters() * batch / gemm_rate
    return {"read_ms": 1e3 * read_s, "gemm_ms": 1e3 * gemm_s, "bound_tok_s": batch / max(read_s, gemm_s)}


def attention_times(batch: int, keys: int, cfg) -> dict[str, float]:
    """Microseconds of one decode-group attention on CPU (batch rows, one query each, `keys` keys, the
    model's heads), bf16 inputs: torch's bf16 SDPA kernel against the engine's (fp32 kernel on copies)."""
    from ..model_runner import sdpa

    q = torch.randn(batch, cfg.n_heads, 1, cfg.head_dim).bfloat16()          # (B, Hq, 1, D)
    k, v = (torch.randn(batch, cfg.n_kv_heads, keys, cfg.head_dim).bfloat16() for _ in range(2))   # (B, Hkv, L, D)
    bf16_kernel = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)   # noqa: E731
    return {"bf16_kernel_us": 1e6 * roofline.time_median(bf16_kernel, 20),
            "engine_fp32_kernel_us": 1e6 * roofline.time_median(lambda: sdpa(q, k, v), 20)}


def before_eos(ids: list[int], eos: int) -> list[int]:
    """ids up to their first end-of-sequence token: past it, ignore_eos (ours) and min_new_tokens
    (transformers: EOS masked) generate different things by design."""
    return ids[:ids.index(eos)] if eos in ids else ids


def compare(base_llm, hf_fp32, dtype_name: str, batch: int, cfg: dict, probe=None) -> dict:
    """The engine (prepacked and not) against transformers' batched generate, interleaved rounds;
    probe (a roofline.BandwidthProbe) is sampled after every timed run where given."""
    from ..llm import LLM
    from ..sampling import SamplingParams

    dtype = getattr(torch, dtype_name)
    tokenizer = base_llm.get_tokenizer()
    words = tokenizer.encode(" ".join(["the lighthouse keeper wrote a letter to the sea"] * 4))[:cfg["prompt_tokens"]]
    model = copy.deepcopy(base_llm.model).to(dtype)
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", max_num_seqs=batch)
    unpacked = LLM(model=model, tokenizer=tokenizer, device="cpu", max_num_seqs=batch)
    unpacked.engine.runner.drop_prepacked()
    hf = copy.deepcopy(hf_fp32).to(dtype)
    n = cfg["new_tokens"]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompts = [{"prompt_token_ids": words} for _ in range(batch)]
    x = torch.tensor([words] * batch)                                     # (B, T) equal lengths: no padding
    tokens, eos = {}, tokenizer.eos_token_id

    def ours(engine_llm, name):
        outs = engine_llm.generate(prompts, params, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]

    def theirs():
        with torch.no_grad():
            out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        tokens["hf_batched"] = out[:, x.shape[1]:].tolist()

    systems = {"engine": lambda: ours(llm, "engine"), "engine_unpacked": lambda: ours(unpacked, "engine_unpacked"),
               "hf_batched": theirs}
    for fn in systems.values():
        fn()                                                              # warm-up
    times = {name: [] for name in systems}
    for _ in range(cfg["rounds"]):
        for name, fn in systems.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if probe is not None:
                probe.sample()
    tok_s = {name: batch * n / statistics.median(v) for name, v in times.items()}
    row = {"dtype": dtype_name, "batch": batch, "new_tokens": n, "prompt_tokens": len(words),
           **{f"{name}_tok_s": v for name, v in tok_s.items()},
           "engine_vs_hf_batched": tok_s["engine"] / tok_s["hf_batched"],
           "prepacked_vs_unpacked": tok_s["engine"] / tok_s["engine_unpacked"],
           "same_tokens_packed_unpacked": tokens["engine"] == tokens["engine_unpacked"],
           "requests_equal_to_hf_before_eos": sum(before_eos(a, eos) == b[:len(before_eos(a, eos))]
                                                  for a, b in zip(tokens["engine"], tokens["hf_batched"])) / batch}
    llm.close()
    unpacked.close()
    return row


def run(quick: bool) -> dict:
    from ..llm import LLM

    cfg = settings(quick)
    base = LLM(model="smollm2", dtype="float32", device="cpu")
    hf_fp32 = dense_hf_model(torch.float32)
    rows, rates = [], {}
    for dtype_name in cfg["dtypes"]:
        dtype = getattr(torch, dtype_name)
        by_route = roofline.measure_gemm_rates(1024 if quick else 2048, dtype)
        probe = roofline.BandwidthProbe(256 if quick else 512, dtype=dtype)
        probe.sample()
        by_batch = [compare(base, hf_fp32, dtype_name, batch, cfg, probe) for batch in cfg["batches"]]
        rates[dtype_name] = {"bandwidth_GBps": probe.best / 1e9,
                             "bandwidth_samples_GBps": [b / 1e9 for b in probe.samples],
                             "gemm_GFLOPs": max(by_route.values()) / 1e9,
                             "gemm_GFLOPs_by_route": {k: v / 1e9 for k, v in by_route.items()}}
        del probe
        for batch, row in zip(cfg["batches"], by_batch):
            bound = step_roofline(base.config, dtype, batch, rates[dtype_name]["bandwidth_GBps"] * 1e9,
                                  rates[dtype_name]["gemm_GFLOPs"] * 1e9)
            row.update({f"roofline_{k}": v for k, v in bound.items()})
            row["engine_fraction_of_roofline"] = row["engine_tok_s"] / bound["bound_tok_s"]
            rows.append(row)
            print(common.format_table([row], ["dtype", "batch", "engine_tok_s", "engine_unpacked_tok_s",
                                              "hf_batched_tok_s", "engine_vs_hf_batched", "prepacked_vs_unpacked",
                                              "engine_fraction_of_roofline"]), flush=True)
    summary = {f"{r['dtype']}_B{r['batch']}": {k: r[k] for k in ("engine_tok_s", "engine_unpacked_tok_s",
                                                                  "hf_batched_tok_s", "engine_vs_hf_batched",
                                                                  "prepacked_vs_unpacked",
                                                                  "engine_fraction_of_roofline")}
               for r in rows}
    summary["machine_rates"] = rates
    summary["prepacked_libraries"] = prepacked.chosen_libraries()
    summary["bf16_decode_attention"] = {f"B{b}": attention_times(b, cfg["prompt_tokens"] + cfg["new_tokens"],
                                                                 base.config) for b in cfg["batches"]}
    return common.document(NAME, {"model": "SmolLM2-135M-Instruct", **cfg, "quick": quick}, rows, summary)
