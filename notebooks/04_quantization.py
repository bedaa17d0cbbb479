# %% [markdown]
# # 04 · Quantisation: int8, int4, NF4, GPTQ, AWQ and an int8 KV cache
#
# *Lesson: [lessons/04-quantization.md](../lessons/04-quantization.md).* The article asks
# **4-bit 量化为什么效果几乎不掉？INT4 和 NF4 区别？** and warns **量化不是免费午餐**.
# This notebook takes the formats apart on real SmolLM2-135M weights; the perplexity table at the end
# is the benchmark `python -m minillm bench quant` (read from `results/quant.json`).
#
# `MINILLM_QUICK=1` shrinks the calibration data (CI does); unset it for the full run.

# %%
import json, math, copy
from pathlib import Path
import torch
import matplotlib.pyplot as plt
from minillm.loading.loader import load_model
from minillm.quant import int4, int8, nf4, quantize_linear, calibration_windows
from minillm.quant.gptq import HessianAccumulator, gptq_quantize
from minillm.quant.awq import block_inputs, search_scales
from minillm.quant.kv_int8 import quantize_kv, dequantize_kv, kv_bytes
from minillm.quant.sequential import SUBLAYER_GROUPS, capture_inputs
from minillm.model.llama import naive_attention_fp32
from minillm.model.positions import rope_cos_sin
from minillm.course.notebook import start

device, QUICK = start()                        # cuda when present; prints the machine
torch.manual_seed(0)
values = {}                                    # the figures lesson 04 quotes, saved by the last cell

# %% [markdown]
# ## 1. INT4 vs NF4: where the 16 levels go
#
# Both formats keep one scale per block and 16 levels. int4 absmax spaces the levels evenly between
# -max and +max; NF4 puts them at quantiles of a normal distribution, dense near 0 where most weights are.
#
# By hand first, on one row of a real weight: cut it into blocks of 64, give each block the scale
# max|w| / 7, round w / scale to an integer in -7..7 and store it as the unsigned code q + 8 in 4 bits, two
# codes per byte. Dequantising is (code - 8) × scale. The scale is kept in fp16, so it is rounded before use.
# The checks compare the codes, the packed bytes and the dequantised row with `minillm.quant.int4`.

# %%
model, tok = load_model("smollm2", dtype="float32", device=device)
row = model.layers[10].ffn.w_up.weight[0].detach().cpu()     # (576,): one output's weights
blocks = row.reshape(-1, 64)                                 # (9, 64): one scale per block
scale = (blocks.abs().amax(1, keepdim=True) / 7).half().float()   # symmetric int4: levels -7..7
codes = (torch.round(blocks / scale) + 8).clamp(0, 15)       # unsigned 4-bit codes
by_hand = ((codes - 8) * scale).flatten()
packed = (codes.flatten()[0::2].to(torch.uint8) << 4) | codes.flatten()[1::2].to(torch.uint8)   # high nibble first
stored = int4.quantize(row[None], 4, 64, symmetric=True)
print("first 8 weights:", [round(x, 4) for x in row[:8].tolist()])
print("their codes    :", codes.flatten()[:8].int().tolist(), "  block 0 scale:", f"{scale[0, 0].item():.3e}")
print("same packed bytes:", torch.equal(packed, stored["packed"][0]),
      "| same dequantised row:", torch.equal(by_hand, int4.fake_quantize(row, 4, 64, symmetric=True)))
print(f"{row.numel() * 4} bytes in fp32 -> {packed.numel()} bytes of codes + {scale.numel() * 2} bytes of fp16 scales")

# %% [markdown]
# The same quantiser on a whole matrix, next to NF4 (layer 10's `w_up`):

# %%
w = model.layers[10].ffn.w_up.weight.detach().cpu()          # (1536, 576), a real weight
blocks = w.reshape(-1, 64)
normalised = (blocks / blocks.abs().amax(1, keepdim=True)).reshape(-1)
int4_levels = torch.arange(-7, 8) / 7
fig, ax = plt.subplots(figsize=(8, 3.2))
ax.hist(normalised.numpy(), bins=200, density=True, alpha=0.5, label="w / absmax of its block of 64")
ax.vlines(nf4.NF4_CODE.numpy(), 0, 0.6, colors="C1", label="NF4 levels")
ax.vlines(int4_levels.numpy(), 0.6, 1.2, colors="C2", label="int4 absmax levels")
ax.set_xlabel("normalised weight"); ax.legend(fontsize=8); ax.set_title("layer 10 w_up: weights vs the two grids")
plt.show()
for name, deq in [("int4 absmax, block 64", int4.fake_quantize(w, 4, 64, symmetric=True)),
                  ("int4 asymmetric, block 64", int4.fake_quantize(w, 4, 64, symmetric=False)),
                  ("NF4, block 64", nf4.dequantize(**nf4.quantize(w, 64), block=64))]:
    print(f"{name:28s} mean |error| = {(deq - w).abs().mean():.3e}   relative = {(deq - w).norm() / w.norm():.4f}")
    values[name] = {"mean_abs_error": (deq - w).abs().mean().item(), "relative_error": ((deq - w).norm() / w.norm()).item()}

# %% [markdown]
# ## 2. What a "4-bit" weight really costs
#
# Codes are 4 bits, but every block also stores its scale (and zero point). Double quantisation
# shrinks NF4's fp32 absmax to 8 bits.

# %%
lin = model.layers[10].ffn.w_down                                   # (576, 1536)
rows = [("fp16", {}, None), ("int8", {}, "int8"), ("int4 g128 sym", {"symmetric": True}, "int4"),
        ("int4 g128 asym", {}, "int4"), ("int4 g32 asym", {"group_size": 32}, "int4"), ("int3 g128", {"bits": 3}, "int4"),
        ("NF4", {}, "nf4"), ("NF4 + double quant", {"double_quant": True}, "nf4")]
for name, kw, method in rows:
    if method is None:
        bits = 16.0
    else:
        q = quantize_linear(lin, method, **kw)
        bits = 8 * q.weight_bytes() / lin.weight.numel()
    print(f"{name:20s} {bits:6.3f} bits/param   {bits / 16:.3f} x fp16")

# %% [markdown]
# ## 3. GPTQ vs round-to-nearest on the layer objective
#
# GPTQ minimises ||W X - Q X||² using the Hessian H = 2/n Σ x xᵀ of the layer's inputs. Below: every
# linear of one block, H from calibration windows, the error measured on a **held-out** window.
# Watch `w_down`: 1536 inputs and only 1536 calibration tokens (full run) give a poor estimate of H, and
# GPTQ over-fits it (ratio > 1); the test uses 4096 tokens, where GPTQ wins on every layer it checks.

# %%
from minillm.evaluate import evaluation_text
n_cal, win = (1, 256) if QUICK else (3, 512)
calib = calibration_windows(tok, n_cal, win).to(device)
held = torch.tensor([tok.encode(evaluation_text())[:win]], device=device)
cos, sin = rope_cos_sin(torch.arange(win, device=device), model.cfg.head_dim, model.cfg.rope_theta)
target = 4 if QUICK else 10
with torch.no_grad():
    h_cal, h_held = model.embed(calib), model.embed(held)
    for block in model.layers[:target]:
        h_cal, h_held = block(h_cal, cos, sin), block(h_held, cos, sin)
    block = model.layers[target]
    names = [n for g in SUBLAYER_GROUPS for n in g]
    acc = {n: HessianAccumulator(block.get_submodule(n).in_features, device) for n in names}
    held_x = {}
    capture_inputs(block, names, h_cal, cos, sin, lambda n, x: acc[n].add(x))
    capture_inputs(block, names, h_held, cos, sin, lambda n, x: held_x.setdefault(n, x[0]))
    print(f"block {target}, H from {n_cal} x {win} calibration tokens, error on {win} held-out tokens (4-bit, g128)")
    for bits in (4, 3):
        for n in names:
            W = block.get_submodule(n).weight
            codes, s, z, perm = gptq_quantize(W, acc[n].hessian(), bits=bits, group_size=128, act_order=True)
            Q = int4.dequantize(**int4.encode(codes, s, z, bits, False, perm), bits=bits, group_size=128)
            R = int4.fake_quantize(W, bits, 128)
            X = held_x[n].reshape(-1, W.shape[1])                      # (T, in)
            e_g, e_r = ((W - Q) @ X.T).pow(2).sum().item(), ((W - R) @ X.T).pow(2).sum().item()
            print(f"  {bits}-bit {n:11s} RTN {e_r:10.4g}   GPTQ {e_g:10.4g}   GPTQ/RTN = {e_g / e_r:.3f}")
            values[f"gptq {bits}-bit {n}"] = {"rtn_error": e_r, "gptq_error": e_g, "gptq_over_rtn": e_g / e_r}

# %% [markdown]
# ## 4. AWQ: the alpha search
#
# s = mean|x|^α per input channel; α = 0 is plain RTN. The loss is the attention block's output error
# with fake-quantised q, k, v. The chosen α can only be better than RTN on the calibration data.
#
# AWQ does *not* keep the top 1% of weights in fp16 (the myth the article repeats): that is the paper's motivating
# experiment (arXiv 2306.00978, section 2.1), rejected as hardware-unfriendly[^nb-awq-s21]. The method scales the salient input
# channels, folds 1/s into the previous layer and stores every weight in int4, which is what this cell does.
#
# [^nb-awq-s21]: published: Lin et al., AWQ (arXiv 2306.00978), Section 2.1 "Improving LLM Quantization by Preserving 1% Salient Weights" (keeping 0.1%-1% of the channels in FP16; "such a mixed-precision data type will make the system implementation difficult") and Section 2.2 (per-channel scaling instead)

# %%
with torch.no_grad():
    blk = copy.deepcopy(model.layers[target])
    x = block_inputs(blk, ["attn.wq", "ffn.w_gate"], h_cal, cos, sin)
    fig, ax = plt.subplots(figsize=(7, 3.2))
    for bits in (4, 3):
        a, s, losses = search_scales(x["attn.wq"], [blk.attn.wq, blk.attn.wk, blk.attn.wv],
                                     lambda t: blk.attn(t, cos, sin), bits=bits, group_size=128)
        ax.plot([i / 20 for i in range(20)], losses, marker="o", label=f"{bits}-bit: best alpha {a:.2f}, "
                f"{losses[0] / min(losses):.2f}x lower loss than RTN")
    ax.set_xlabel("alpha"); ax.set_ylabel("attention output MSE"); ax.set_yscale("log"); ax.legend(fontsize=8)
    ax.set_title(f"block {target}: q/k/v scale search")
    plt.show()
    xm = x["attn.wq"].abs().reshape(-1, 576).mean(0).cpu()
    print("input channel mean |x|: max / median =", round((xm.max() / xm.median()).item(), 1), "(salient channels)")
    values["awq input channel max/median"] = (xm.max() / xm.median()).item()

# %% [markdown]
# ## 5. int8 KV cache
#
# One scale per (token, head): 66 bytes instead of 128 per head and token (head_dim 64). The cell prints how far
# the attention output moves (its relative error); a key channel that is an outlier sets every token's scale and
# makes that error larger.

# %%
with torch.no_grad():
    q_, k_, v_ = block.attn.project_qkv(block.attn_norm(h_held), cos, sin)    # real q, k, v of one block
    for name, (k_in, v_in) in {"real K/V (block %d)" % target: (k_, v_)}.items():
        kq, ks = quantize_kv(k_in); vq, vs = quantize_kv(v_in)
        ref = naive_attention_fp32(q_, k_in, v_in)
        out = naive_attention_fp32(q_, dequantize_kv(kq, ks), dequantize_kv(vq, vs))
        print(f"{name}: attention output relative error {((out - ref).norm() / ref.norm()).item():.4f}; "
              f"bytes vs fp16 {kv_bytes(kq, ks) / (k_in.numel() * 2):.3f}")
        values["kv int8"] = {"relative_error": ((out - ref).norm() / ref.norm()).item(),
                             "bytes_vs_fp16": kv_bytes(kq, ks) / (k_in.numel() * 2)}
    ch = k_.abs().mean((0, 1, 2)).cpu()
    print("K channel mean |k|: max / median =", round((ch.max() / ch.median()).item(), 1))
    values["k channel max/median"] = (ch.max() / ch.median()).item()

# %% [markdown]
# ## 6. The measured table (`python -m minillm bench quant`)
#
# Perplexity on the evaluation text (never used for calibration), bits per parameter of the linear layers
# (scales included), decode tokens/s on this CPU. Baseline caveat: "fp32" is the Q4_1 GGUF dequantised, so every 4-bit row re-quantises weights that were already
# on a 4-bit grid: a second rounding, which makes int4 RTN's loss here far larger than a 7B model's (lesson 04).

# %%
path = Path("../results/quant.json")
if path.exists():
    doc = json.loads(path.read_text())
    print(doc["machine"]["cpu"], "| threads", doc["machine"]["threads"])
    print(f"{'method':>22} {'ppl':>8} {'bits/param':>10} {'vs fp16':>8} {'MB':>6} {'decode tok/s':>12} {'quantise s':>10}")
    cell = lambda r, key, width, spec: f"{r[key]:{width}{spec}}" if r.get(key) is not None else " " * (width - 1) + "-"
    for r in doc["results"]:
        print(f"{r['method']:>22} " + " ".join(cell(r, k, w, s) for k, w, s in
              (("ppl", 8, ".2f"), ("bits_per_param", 10, ".2f"), ("vs_fp16", 8, ".3f"), ("model_MB", 6, ".0f"),
               ("decode_tok_s", 12, ".1f"), ("quantize_s", 10, ".1f"))))
    print(json.dumps(doc["summary"]["targets"], indent=1))
    from IPython.display import Image, display
    display(Image(filename="../results/quant.png"))              # drawn by the benchmark from the same JSON
else:
    print("results/quant.json not found: run  python -m minillm bench quant --json results/quant.json")

# %% [markdown]
# ## 6b. Does the calibration generalise? (`python -m minillm bench calibration`)
#
# GPTQ and AWQ learn from calibration text; a sceptical reader scores them on text they never saw. The
# benchmark calibrates on Python's docs, on text sampled from the model itself, or on a mix, with 4, 8 or 32
# windows of 512 tokens, and scores every model on Python's docs and three texts never used for calibration
# (GPL v3; the Apache and MPL licences; Vim's licence). With 8 windows of Python's docs, GPTQ 4-bit scores
# 22.85 on Apache + MPL, worse than plain RTN's 20.73; with 32 windows, 20.49[^nb-cal-ood]: too few tokens
# give a poor Hessian for `w_down`'s 1536 inputs (section 3), and GPTQ over-fits it. That is why
# `LLM(quantization="gptq")` calibrates on 32 windows. The table below reads every configuration run.
#
# [^nb-cal-ood]: measured in results/calibration.json: summary.ppl["gptq-4bit-python-docs-n8"]["apache-mpl"]; summary.ppl["rtn-4bit"]["apache-mpl"]; summary.ppl["gptq-4bit-python-docs-n32"]["apache-mpl"]

# %%
path = Path("../results/calibration.json")
if path.exists():
    cal = json.loads(path.read_text())["summary"]
    domains = cal["domains"]
    print(f"{'4-bit, group 128':34s}" + "".join(f"{d:>13s}" for d in domains) + "   below RTN everywhere")
    for config, ppl in cal["ppl"].items():
        if "3bit" in config:
            continue
        wins = cal["beats_rtn_everywhere_by_config"].get(config, "")
        print(f"{config:34s}" + "".join(f"{ppl[d]:13.2f}" for d in domains) + f"   {wins}")
else:
    print("results/calibration.json not found: run  python -m minillm bench calibration")

# %% [markdown]
# ## 7. The fused W4A16 kernel
#
# Dequantise inside the matmul tile loop so that only 4-bit codes cross the memory bus. On CPU the
# PyTorch twin (same tiling) shows the arithmetic; on a GPU the Triton kernels run (the split-K GEMV at
# batch 1, tensor cores at 16) and are timed with CUDA events after an L2 flush. Lesson 04 counts the GEMV's instruction budget on an H200: the
# compiled loop issues more instructions per weight than the SMs can issue while HBM streams the weights, so even a
# perfect run reaches only part of the bandwidth (`roofline.gemv_instruction_budget`).

# %%
from minillm.quant.w4a16 import w4a16_matmul_torch, operands
q = quantize_linear(model.layers[target].ffn.w_down, "int4").to(device)
x = torch.randn(4, q.in_features, device=device)
ops = operands(q)
y = w4a16_matmul_torch(x, ops["packed"], ops["scale"], ops["zero"], ops["code"], group=ops["group"])
print("twin vs dequantise-then-matmul: max |diff| =", (y - x @ q.dequantize().T).abs().max().item())
if torch.cuda.is_available():
    from minillm.quant.w4a16 import w4a16_linear
    for rows in (1, 16):                                         # the split-K GEMV, then the tensor-core kernel
        xh = torch.randn(rows, q.in_features, device=device, dtype=torch.float16)
        ref = w4a16_matmul_torch(xh.float(), ops["packed"], ops["scale"], ops["zero"], ops["code"], group=ops["group"])
        print(f"{rows:2d} rows: Triton kernel vs twin: max |diff| = {(w4a16_linear(xh, q).float() - ref).abs().max().item():.1e}")
    print("the kernel's timing (fp16 matmul vs W4A16, batch 1..16, CUDA events): make gpu-check, results/gpu/")
else:
    print("no GPU here: the Triton kernels are not run (their timing: make gpu-check, results/gpu/)")

# %%
from minillm.course.notebook import save_notebook_values
print("saved", save_notebook_values("04", values, QUICK) or "nothing (quick mode)")
