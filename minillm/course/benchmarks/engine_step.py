"""The engine's step against transformers' at the SAME batch: equal requests, no padding, no scheduling.

    python -m minillm bench engine-step [--quick] [--json results/engine-step.json]

Continuous batching beats a padded batch by scheduling (bench batching); this benchmark takes
scheduling away to ask whether one engine step is itself fast. B requests with the same 16-token
prompt and B x new_tokens greedy tokens each (ignore_eos), through

    engine            LLM.generate: the batching engine, weights prepacked (minillm/model/prepacked.py)
    engine_unpacked   the same engine with plain F.linear (what prepacking buys)
    hf_batched        transformers' generate on the same B prompts as one batch (dense weights,
                      same dtype, KV cache on); equal lengths, so no padding

in fp32 and bf16, B = 16, 48 and 64; the three run in turn in every round (interleaved), medians over
rounds after a warm-up. Output tokens per second of wall time, prompt included.

The roofline of a decode step at batch B reads every weight once and does 2 FLOPs per weight per
row: step time >= max(weight bytes / bandwidth, 2 * params * B / GEMM rate), both rates measured
in this run in the same dtype (the bandwidth by roofline.BandwidthProbe, sampled after every timed
run, the fastest sample kept: it moves on a VM; the GEMM rate is the fastest of torch's
a @ b and each prepacking library's GEMM on a square 2048 matrix, sampled after every round like the
bandwidth and the fastest sample of each route kept, all recorded:
roofline.GemmProbe, machine_rates.<dtype>.gemm_GFLOPs_by_route and gemm_GFLOPs_samples). The libraries prepacking chose per weight
shape are recorded (summary.prepacked_libraries), and so is why the engine attends in fp32 on CPU:
one bf16 decode-group attention by torch's bf16 SDPA kernel against the engine's fp32 one on upcast
copies, and from a paged cache, gather + SDPA against the engine's fused kernel
(summary.bf16_decode_attention at the run's context, bf16_decode_attention_long at 512 keys).

Between the roofline and the engine sits the GEMM floor: the engine's own prepacked GEMMs at B rows
and nothing else, every layer's and the LM head's in order, timed once per round right after the
engine (gemm_floor_ms). It is what this GEMM library does at these shapes: the roofline's rate is a
square 2048 GEMM's, and 16 to 64 rows reuse each weight too few times to reach it
(gemm_floor_fraction_of_roofline). The engine's median decode-only step (engine_decode_step_ms,
from its step log) minus the floor is everything else a step does: attention, norms, RoPE, copies,
Python (gemm_floor_share_of_step is the floor's share; its inverse is how many times the floor a
step takes).
"""
from __future__ import annotations

import copy
import statistics
import time

import torch

from minillm.perf import roofline
from . import common
from .kv_cache import dense_hf_model

NAME = "engine-step"
SYSTEMS = ("engine", "engine_unpacked", "hf_batched")


def settings(quick: bool) -> dict:
    if quick:
        return dict(batches=(4,), dtypes=("float32",), new_tokens=4, rounds=2, prompt_tokens=8)
    return dict(batches=(16, 48, 64), dtypes=("float32", "bfloat16"), new_tokens=32, rounds=3, prompt_tokens=16)


def step_roofline(cfg, dtype: torch.dtype, batch: int, bandwidth: float, gemm_rate: float) -> dict:
    """Lower bound on one decode step's time at `batch` rows: weights read once, 2 FLOPs per weight and row."""
    elem = torch.tensor([], dtype=dtype).element_size()
    read_s = roofline.weight_bytes(cfg, elem) / bandwidth
    gemm_s = 2 * cfg.num_parameters() * batch / gemm_rate
    return {"read_ms": 1e3 * read_s, "gemm_ms": 1e3 * gemm_s, "bound_tok_s": batch / max(read_s, gemm_s)}


def attention_times(batch: int, keys: int, cfg, block_size: int = 16) -> dict[str, float]:
    """Microseconds of one decode-group attention on CPU (batch rows, one query each, `keys` keys, the
    model's heads), bf16 inputs. On K/V already laid out per request: torch's bf16 SDPA kernel against
    its fp32 one on upcast copies (attention.sdpa). From a paged cache (each request's blocks
    scattered over a pool): gather + upcast + SDPA (the engine's path before, and still its fallback)
    against the fused compiled kernel that reads the blocks in place (attention.fused_decode_attention)."""
    from minillm.attention.backends import decode_attention_gathered, fused_decode_attention, sdpa

    H, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = torch.randn(batch, H, 1, D).bfloat16()                                # (B, Hq, 1, D)
    k, v = (torch.randn(batch, Hkv, keys, D).bfloat16() for _ in range(2))   # (B, Hkv, L, D)
    bf16_kernel = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)   # noqa: E731
    n = -(-keys // block_size)
    pool = [torch.randn(batch * n + 1, block_size, Hkv, D).bfloat16() for _ in range(2)]   # (blocks, bs, Hkv, D)
    tables = torch.randperm(batch * n + 1)[:batch * n].view(batch, n)         # (B, n)
    lens = torch.full((batch,), keys)
    paged = (q[:, :, 0], *pool, tables, lens)
    return {"bf16_kernel_us": 1e6 * roofline.time_median(bf16_kernel, 20),
            "engine_fp32_kernel_us": 1e6 * roofline.time_median(lambda: sdpa(q, k, v), 20),
            "paged_gather_sdpa_us": 1e6 * roofline.time_median(lambda: decode_attention_gathered(*paged), 20),
            "paged_fused_us": 1e6 * roofline.time_median(lambda: fused_decode_attention(*paged), 20)}


def gemm_floor_ms(runner, batch: int, repeats: int = 10) -> float:
    """The step's weight GEMMs and nothing else: every prepacked linear of every layer, then the LM
    head, at `batch` rows, in layer order (so each weight comes from memory as it does in a step);
    median ms. A step through these GEMMs cannot be faster than this with this library; the rest
    of a step (attention, norms, RoPE, copies, Python) comes on top."""
    layers = runner.packed_layers
    if not layers or any(p is None for layer in layers for p in layer) or runner.packed_head is None:
        raise ValueError("gemm_floor_ms needs a runner with prepacked weights (an engine built on CPU with prepack_rows)")
    cfg, dtype = runner.model.cfg, runner.model.embed.weight.dtype
    x = torch.randn(batch, cfg.dim, dtype=dtype)                              # (B, dim): values do not change speed
    attn_out = torch.randn(batch, cfg.n_heads * cfg.head_dim, dtype=dtype)   # (B, Hq * D)
    hidden = torch.randn(batch, cfg.ffn_dim, dtype=dtype)                     # (B, ffn)

    def gemms():
        for wqkv, wo, w_gate_up, w_down in layers:
            wqkv(x), wo(attn_out), w_gate_up(x), w_down(hidden)
        runner.packed_head(x)

    return 1e3 * roofline.time_median(gemms, repeats)


def decode_step_ms(step_log) -> float:
    """Median wall time of the engine's steps in which every request decoded one token (no prefill)."""
    times = [1e3 * s["seconds"] for s in step_log if s["num_decodes"] == s["num_seqs"] == s["num_tokens"]]
    if not times:
        raise ValueError("no decode-only step in the step log")
    return statistics.median(times)


def before_eos(ids: list[int], eos: int) -> list[int]:
    """ids up to their first end-of-sequence token: past it, ignore_eos (ours) and min_new_tokens
    (transformers: EOS masked) generate different things by design."""
    return ids[:ids.index(eos)] if eos in ids else ids


def compare(base_llm, hf_fp32, dtype_name: str, batch: int, cfg: dict, probe=None, gemm_probe=None) -> dict:
    """The engine (prepacked and not) against transformers' batched generate, interleaved rounds;
    probe (a roofline.BandwidthProbe) is sampled after every timed run where given, gemm_probe
    (a roofline.GemmProbe) after every round."""
    from minillm.llm import LLM
    from minillm.engine.sampling import SamplingParams

    dtype = getattr(torch, dtype_name)
    tokenizer = base_llm.get_tokenizer()
    words = tokenizer.encode(" ".join(["the lighthouse keeper wrote a letter to the sea"] * 4))[:cfg["prompt_tokens"]]
    model = copy.deepcopy(base_llm.model).to(dtype)
    llm = LLM(model=model, tokenizer=tokenizer, device="cpu", max_num_seqs=batch)
    unpacked = LLM(model=model, tokenizer=tokenizer, device="cpu", max_num_seqs=batch, tune_kernels=False)
    unpacked.engine.runner.drop_prepacked()
    hf = copy.deepcopy(hf_fp32).to(dtype)
    n = cfg["new_tokens"]
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    prompts = [{"prompt_token_ids": words} for _ in range(batch)]
    x = torch.tensor([words] * batch)                                     # (B, T) equal lengths: no padding
    tokens, eos = {}, tokenizer.eos_token_id

    step_ms = []                                                          # the engine's decode steps, timed runs

    def ours(engine_llm, name):
        engine_llm.engine.step_log.clear()
        outs = engine_llm.generate(prompts, params, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
        if name == "engine":
            step_ms.append(decode_step_ms(engine_llm.engine.step_log))

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
    step_ms.clear()
    floors = []                                                           # the GEMM floor, once per round
    for _ in range(cfg["rounds"]):
        for name, fn in systems.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            if name == "engine":
                floors.append(gemm_floor_ms(llm.engine.runner, batch, repeats=5))
        if gemm_probe is not None:
            gemm_probe.sample()
            if probe is not None:
                probe.sample()
    tok_s = {name: batch * n / statistics.median(v) for name, v in times.items()}
    row = {"dtype": dtype_name, "batch": batch, "new_tokens": n, "prompt_tokens": len(words),
           **{f"{name}_tok_s": v for name, v in tok_s.items()},
           "engine_vs_hf_batched": tok_s["engine"] / tok_s["hf_batched"],
           "prepacked_vs_unpacked": tok_s["engine"] / tok_s["engine_unpacked"],
           "engine_decode_step_ms": statistics.median(step_ms), "gemm_floor_ms": statistics.median(floors),
           "gemm_floor_share_of_step": statistics.median(floors) / statistics.median(step_ms),
           "same_tokens_packed_unpacked": tokens["engine"] == tokens["engine_unpacked"],
           "gemm_libraries": llm.engine.runner.gemm_libraries,           # the build's tuning step chose these
           "requests_equal_to_hf_before_eos": sum(before_eos(a, eos) == b[:len(before_eos(a, eos))]
                                                  for a, b in zip(tokens["engine"], tokens["hf_batched"])) / batch}
    llm.close()
    unpacked.close()
    return row


def run(quick: bool) -> dict:
    from minillm.llm import LLM

    cfg = settings(quick)
    base = LLM(model="smollm2", dtype="float32", device="cpu")
    hf_fp32 = dense_hf_model(torch.float32)
    rows, rates = [], {}
    for dtype_name in cfg["dtypes"]:
        dtype = getattr(torch, dtype_name)
        gemm_probe = roofline.GemmProbe(1024 if quick else 2048, dtype)
        gemm_probe.sample()
        probe = roofline.BandwidthProbe(256 if quick else 512, dtype=dtype)
        probe.sample()
        by_batch = [compare(base, hf_fp32, dtype_name, batch, cfg, probe, gemm_probe) for batch in cfg["batches"]]
        by_route = gemm_probe.best
        rates[dtype_name] = {"bandwidth_GBps": probe.best / 1e9,
                             "bandwidth_samples_GBps": [b / 1e9 for b in probe.samples],
                             "gemm_GFLOPs": max(by_route.values()) / 1e9,
                             "gemm_GFLOPs_by_route": {k: v / 1e9 for k, v in by_route.items()},
                             "gemm_GFLOPs_samples": [max(r.values()) / 1e9 for r in gemm_probe.samples]}
        del probe
        for batch, row in zip(cfg["batches"], by_batch):
            bound = step_roofline(base.config, dtype, batch, rates[dtype_name]["bandwidth_GBps"] * 1e9,
                                  rates[dtype_name]["gemm_GFLOPs"] * 1e9)
            row.update({f"roofline_{k}": v for k, v in bound.items()})
            row["engine_fraction_of_roofline"] = row["engine_tok_s"] / bound["bound_tok_s"]
            row["gemm_floor_fraction_of_roofline"] = max(bound["read_ms"], bound["gemm_ms"]) / row["gemm_floor_ms"]
            rows.append(row)
            print(common.format_table([row], ["dtype", "batch", "engine_tok_s", "engine_unpacked_tok_s",
                                              "hf_batched_tok_s", "engine_vs_hf_batched", "prepacked_vs_unpacked",
                                              "engine_fraction_of_roofline", "engine_decode_step_ms",
                                              "gemm_floor_ms", "gemm_floor_fraction_of_roofline"]), flush=True)
    summary = {f"{r['dtype']}_B{r['batch']}": {k: r[k] for k in ("engine_tok_s", "engine_unpacked_tok_s",
                                                                  "hf_batched_tok_s", "engine_vs_hf_batched",
                                                                  "prepacked_vs_unpacked",
                                                                  "engine_fraction_of_roofline",
                                                                  "engine_decode_step_ms", "gemm_floor_ms",
                                                                  "gemm_floor_share_of_step",
                                                                  "gemm_floor_fraction_of_roofline")}
               for r in rows}
    summary["machine_rates"] = rates
    summary["prepacked_libraries"] = {k: v for r in rows for k, v in r["gemm_libraries"].items()}
    summary["bf16_decode_attention"] = {f"B{b}": attention_times(b, cfg["prompt_tokens"] + cfg["new_tokens"],
                                                                 base.config) for b in cfg["batches"]}
    summary["bf16_decode_attention_long"] = {f"B{b}": attention_times(b, 128 if quick else 512, base.config)
                                             for b in cfg["batches"]}
    return common.document(NAME, {"model": "SmolLM2-135M-Instruct", **cfg, "quick": quick}, rows, summary)
