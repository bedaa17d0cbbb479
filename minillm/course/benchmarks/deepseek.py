"""Lesson 13: DeepSeek's two ideas measured on this CPU, and the arithmetic of the published models.

    kv          bytes per token and layer: the engine's latent pool for DeepSeek-V3's shape (allocated) against
                the same model's MHA and a GQA-8 twin (counted)
    absorb      one MLA layer at DeepSeek-V2-Lite's widths: a decode row over S cached latents, naive (expand
                the latents every step), naive over an expanded K/V cache (MHA's memory), absorbed; a prefill
                of T tokens, naive against absorbed
    experts     the experts a decode step touches against its batch: DeepSeek-V3's router on random scores
                against the even-routing formula, and the weights a step reads
    grouped     a MoE layer at DeepSeek-V2-Lite's widths, one GEMM per expert against token by token
    balance     the auxiliary-loss-free bias update on a router skewed towards some experts
    ep          expert parallelism over 2 gloo ranks: bytes sent against the formula; EP against TP per GPU for
                the same global batch (counted, DeepSeek-V3)
"""
from __future__ import annotations

import dataclasses
import os
import statistics

import torch
import torch.nn.functional as F

from minillm.course.calculators import experts_touched, mha_cache_values_per_token, moe_step_weight_bytes
from minillm.model.llama import ModelConfig, random_model, sdpa_attention, tiny_config
from minillm.model.mla import LatentAttention, MLAShape
from minillm.model.moe import MoE, MoEShape, balance_bias_update, expert_load, grouped, imbalance, per_token, route
from minillm.model.positions import rope_cos_sin
from minillm.model.runner import PagedKVCache
from minillm.parallel.calculator import ep_bytes_per_token, tp_bytes_per_token
from .common import document, figure_path, time_median

NAME = "deepseek"


def kv_rows() -> list[dict]:
    v3 = ModelConfig.named("deepseek-v3")
    pool = PagedKVCache(v3, num_blocks=1, block_size=16, dtype=torch.bfloat16)
    latent = pool.nbytes / 16 / v3.n_layers / 2                       # values per token and layer, allocated
    rows = [{"part": "kv", "layout": "MLA latent (engine pool, allocated)", "values_per_token_layer": latent,
             "KiB_per_token_bf16": pool.nbytes / 16 / 1024}]
    for layout, heads in (("expanded MHA (each head's K 192 + V 128)", None), ("expanded GQA-8 (8 K/V heads)", 8)):
        values = mha_cache_values_per_token("deepseek-v3", heads)
        rows.append({"part": "kv", "layout": layout, "values_per_token_layer": values,
                     "KiB_per_token_bf16": values * v3.n_layers * 2 / 1024, "times_mla": values / latent})
    return rows


def _layer(cfg: ModelConfig, seed: int = 0) -> LatentAttention:
    gen = torch.Generator().manual_seed(seed)
    attn = LatentAttention(cfg)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            p.copy_(torch.ones(p.shape) if "norm" in name else torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return attn.eval()


@torch.no_grad()
def absorb_rows(quick: bool) -> list[dict]:
    """Seconds per call, medians; every variant's output checked against the naive one first."""
    cfg = ModelConfig.named("deepseek-v2-lite")
    attn, s, H = _layer(cfg), cfg.mla, cfg.n_heads
    gen = torch.Generator().manual_seed(1)
    rows, repeats = [], 3 if quick else 7
    for S in ((256, 1024) if quick else (512, 2048, 8192)):
        x = torch.randn(1, S, cfg.dim, generator=gen)
        cos, sin = rope_cos_sin(torch.arange(S), cfg.head_dim, cfg.rope_theta)
        c, k_rope = attn.latents(x, cos, sin)                                  # the latent cache: (1, S, r), (1, S, d_rope)
        k_full, v_full = attn.expand(c, k_rope)                                # an MHA-style cache: (1, H, S, 192), (1, H, S, 128)
        q = attn.queries(x[:, -1:], cos[-1:], sin[-1:])                        # the last position's query (1, H, 1, 192)

        def naive():
            return F.scaled_dot_product_attention(q, *attn.expand(c, k_rope), scale=s.scale())

        def expanded():
            return F.scaled_dot_product_attention(q, k_full, v_full, scale=s.scale())

        def absorbed():
            return attn.attend_absorbed(q, c, k_rope)

        ref = naive()
        for fn in (expanded, absorbed):
            assert (fn() - ref).abs().max().item() < 1e-4 * ref.abs().max().item() + 1e-6
        t = {name: time_median(fn, repeats=repeats) for name, fn in
             (("naive", naive), ("expanded", expanded), ("absorbed", absorbed))}
        rows.append({"part": "absorb", "phase": "decode", "cached": S, "naive_ms": t["naive"] * 1e3,
                     "expanded_cache_ms": t["expanded"] * 1e3, "absorbed_ms": t["absorbed"] * 1e3,
                     "naive_over_absorbed": t["naive"] / t["absorbed"],
                     "expanded_over_absorbed": t["expanded"] / t["absorbed"],
                     "cache_values_per_token_expanded": H * (s.qk_head_dim + s.v_head_dim),
                     "cache_values_per_token_latent": s.cache_width})
    for T in ((128, 512) if quick else (128, 512, 2048)):
        x = torch.randn(1, T, cfg.dim, generator=gen)
        cos, sin = rope_cos_sin(torch.arange(T), cfg.head_dim, cfg.rope_theta)
        ref = attn(x, cos, sin, sdpa_attention)
        assert (attn(x, cos, sin, sdpa_attention, absorbed=True) - ref).abs().max().item() < 1e-4 * ref.abs().max().item()
        t_naive = time_median(lambda: attn(x, cos, sin, sdpa_attention), repeats=repeats)
        t_abs = time_median(lambda: attn(x, cos, sin, sdpa_attention, absorbed=True), repeats=repeats)
        rows.append({"part": "absorb", "phase": "prefill", "tokens": T, "naive_ms": t_naive * 1e3,
                     "absorbed_ms": t_abs * 1e3, "naive_over_absorbed": t_naive / t_abs})
    return rows


def experts_rows(quick: bool) -> list[dict]:
    """Distinct experts per MoE layer and step, DeepSeek-V3's router on N(0, 1) scores (random inputs: the
    routing math is the model's, the scores are not a trained model's), against the even-routing formula."""
    moe = ModelConfig.named("deepseek-v3").moe
    gen = torch.Generator().manual_seed(2)
    rows, trials = [], 5 if quick else 30
    for batch in (1, 4, 16, 64, 256):
        seen = [len(set(route(torch.randn(batch, moe.n_experts, generator=gen), moe)[1].flatten().tolist()))
                for _ in range(trials)]
        rows.append({"part": "experts", "batch": batch, "touched_router": statistics.mean(seen),
                     "touched_formula": experts_touched(batch, moe.n_experts, moe.top_k),
                     "step_weight_GB_fp8": moe_step_weight_bytes("deepseek-v3", batch, 1) / 1e9})
    return rows


@torch.no_grad()
def grouped_rows(quick: bool) -> list[dict]:
    cfg = ModelConfig.named("deepseek-v2-lite")
    if quick:
        cfg = cfg.replace(moe=dataclasses.replace(cfg.moe, n_experts=16))
    gen = torch.Generator().manual_seed(3)
    layer = MoE(cfg)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    layer = layer.to(torch.bfloat16)
    rows = []
    for tokens in ((8, 64) if quick else (8, 64, 256)):
        x = torch.randn(tokens, cfg.dim, generator=gen).to(torch.bfloat16)
        weights, experts = layer.routing(x)
        args = (x, weights, experts, layer.w_gate, layer.w_up, layer.w_down)
        ref = per_token(*args).float()
        assert (grouped(*args).float() - ref).abs().max().item() < 0.05 * ref.abs().max().item()   # bf16 sums
        t_tok = time_median(lambda: per_token(*args), repeats=3)
        t_grp = time_median(lambda: grouped(*args), repeats=3)
        rows.append({"part": "grouped", "tokens": tokens, "experts": cfg.moe.n_experts, "top_k": cfg.moe.top_k,
                     "distinct_experts": len(set(experts.flatten().tolist())), "per_token_ms": t_tok * 1e3,
                     "grouped_ms": t_grp * 1e3, "per_token_over_grouped": t_tok / t_grp})
    return rows


def balance_rows(steps: int = 60) -> list[dict]:
    """A router whose logits lean towards the high-numbered experts (a ramp of -1.5 .. 1.5 added to N(0, 1)):
    imbalance (busiest expert / mean) at each step of 256 tokens while the bias is updated with gamma = 0.02."""
    shape = MoEShape(n_experts=16, top_k=4, expert_ffn_dim=8, router="sigmoid")
    gen, skew, bias = torch.Generator().manual_seed(5), torch.linspace(-1.5, 1.5, 16), torch.zeros(16)
    by_step = []
    for _ in range(steps):
        load = expert_load(route(torch.randn(256, 16, generator=gen) + skew, shape, bias)[1], 16)
        by_step.append(imbalance(load))
        bias = balance_bias_update(bias, load, gamma=0.02)
    return [{"part": "balance", "experts": 16, "top_k": 4, "tokens_per_step": 256, "gamma": 0.02,
             "imbalance_by_step": by_step}]


# A tiny MLA + MoE model for the gloo run: 2 MoE layers of 16 experts, top 4 (routing close to even).
EP_CONFIG = tiny_config(n_layers=3, n_kv_heads=6, head_dim=8, mla=MLAShape(24, 32, 16, 8, 12),
                        moe=MoEShape(n_experts=16, top_k=4, expert_ffn_dim=32, router="sigmoid", n_shared=1,
                                     first_dense=1))


def _ep_rank(rank: int, size: int) -> int:
    from minillm.parallel import comm
    from minillm.parallel.expert import shard_experts

    model = shard_experts(random_model(EP_CONFIG, seed=1), rank, size)
    ids = torch.randint(0, 256, (1, 256), generator=torch.Generator().manual_seed(10 + rank))
    comm.reset_counts()
    with torch.no_grad():
        model(ids)
    return comm.COUNTS["all_to_all.bytes"]


def ep_rows() -> list[dict]:
    from minillm.parallel.launch import launch

    sent = launch(_ep_rank, 2)
    formula = 256 * ep_bytes_per_token(EP_CONFIG, 2, 4)
    rows = [{"part": "ep", "model": "tiny (2 MoE layers of 16 experts, top 4, fp32)", "ranks": 2, "tokens_per_rank": 256,
             "bytes_rank0": sent[0], "bytes_rank1": sent[1], "formula_bytes": formula,
             "measured_over_formula": statistics.mean(sent) / formula}]
    v3 = ModelConfig.named("deepseek-v3")
    for ranks in (8, 32):
        # The same global batch on `ranks` GPUs: with TP every GPU works on every token and all-reduces it; with
        # EP (attention data-parallel) each GPU holds 1/ranks of the tokens and sends only its own.
        ep = ep_bytes_per_token(v3, ranks, 2)                         # per token this GPU owns
        tp = 2 * (ranks - 1) / ranks * tp_bytes_per_token(v3, 2)      # ring all-reduce: 2 (N-1)/N of the payload
        rows.append({"part": "ep", "model": "deepseek-v3 (bf16, counted)", "ranks": ranks,
                     "ep_KB_per_own_token": ep / 1e3, "ep_KB_per_gpu_per_batch_token": ep / ranks / 1e3,
                     "tp_ring_KB_per_gpu_per_batch_token": tp / 1e3, "ep_over_tp_same_batch": ep / ranks / tp})
    return rows


def plot(results: list[dict], path: str) -> None:
    """Left: values cached per token and layer (DeepSeek-V3's shape; K and V as this model's naive form expands them). Right: the weights a decode step reads
    against its batch (FP8), the touched experts from the formula and from the router."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kv = [r for r in results if r["part"] == "kv"]
    experts = [r for r in results if r["part"] == "experts"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar([r["layout"].split(" (")[0] for r in kv], [r["values_per_token_layer"] for r in kv], color=["C2", "C3", "C1"])
    left.set_yscale("log")
    left.set_ylabel("values cached per token and layer")
    left.set_title("DeepSeek-V3's KV cache: latent vs K and V")
    batches = [r["batch"] for r in experts]
    right.plot(batches, [r["step_weight_GB_fp8"] for r in experts], "o-", label="weights read per step (FP8, GB)")
    right.axhline(ModelConfig.named("deepseek-v3").num_parameters() / 1e9, ls="--", color="gray", label="all weights")
    right.set_xscale("log", base=2)
    right.set_xlabel("decode batch (tokens per step)")
    right.set_ylabel("GB")
    twin = right.twinx()
    twin.plot(batches, [r["touched_router"] for r in experts], "s:", color="C1", label="experts touched per layer (router)")
    twin.set_ylabel("experts touched of 256")
    right.set_title("A MoE decode step reads the experts its batch routes to")
    lines = right.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    right.legend(lines, [line.get_label() for line in lines], loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(quick: bool, json_path: str | None = None) -> dict:
    results = kv_rows() + absorb_rows(quick) + experts_rows(quick) + grouped_rows(quick) + balance_rows() + ep_rows()
    path = figure_path(json_path, "", "deepseek.png", quick)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    plot(results, path)

    def one(part, **match):
        return next(r for r in results if r["part"] == part and all(r.get(k) == v for k, v in match.items()))

    balance = one("balance")["imbalance_by_step"]
    decode = [r for r in results if r["part"] == "absorb" and r["phase"] == "decode"]
    prefill = [r for r in results if r["part"] == "absorb" and r["phase"] == "prefill"]
    summary = {
        "mla_values_per_token_layer": one("kv", layout="MLA latent (engine pool, allocated)")["values_per_token_layer"],
        "mha_over_mla": one("kv", layout="expanded MHA (each head's K 192 + V 128)")["times_mla"],
        "gqa8_over_mla": one("kv", layout="expanded GQA-8 (8 K/V heads)")["times_mla"],
        "decode_naive_over_absorbed": {str(r["cached"]): r["naive_over_absorbed"] for r in decode},
        "decode_expanded_over_absorbed": {str(r["cached"]): r["expanded_over_absorbed"] for r in decode},
        "prefill_naive_over_absorbed": {str(r["tokens"]): r["naive_over_absorbed"] for r in prefill},
        "experts_touched": {str(r["batch"]): r["touched_router"] for r in results if r["part"] == "experts"},
        "grouped_speedup": {str(r["tokens"]): r["per_token_over_grouped"] for r in results if r["part"] == "grouped"},
        "imbalance_first": balance[0], "imbalance_last10_median": statistics.median(balance[-10:]),
        "ep_measured_over_formula": one("ep", ranks=2)["measured_over_formula"],
        "ep_over_tp_same_batch": {str(n): one("ep", ranks=n)["ep_over_tp_same_batch"] for n in (8, 32)},
    }
    config = {"absorb_model": "deepseek-v2-lite widths, one layer, fp32, random weights, torch SDPA",
              "grouped_model": "deepseek-v2-lite MoE layer, bf16, random weights", "threads": torch.get_num_threads()}
    return document(NAME, config, results, summary)
