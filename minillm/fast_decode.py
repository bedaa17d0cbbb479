"""Fast batch-1 decode: the same math as kv_cache.forward_cached with the overhead taken out.

At batch 1 a decode step must stream every weight once (lesson 01's bound); everything else
is overhead: one kernel launch + Python dispatch per small op, per layer. What this adds:

  1. fused projections: q, k, v come from ONE matrix [wq; wk; wv] and gate, up from ONE
     [w_gate; w_up]: 5 GEMVs per layer become 2 (fewer launches, longer contiguous reads);
     the original modules' weights become views into the fused ones, so nothing is copied
     and the naive model still runs on the very same numbers;
  2. fewer small ops: RoPE as ONE complex multiply by a precomputed e^{i*angle} table, for q
     and k together (the interleaved (even, odd) pairs are complex numbers; 3 kernels instead
     of ~18; positions.RopeTable, apply_rope_complex), and RMSNorm as one fused kernel
     (F.rms_norm) instead of 7 elementwise ones;
  3. attention by torch's fused scaled_dot_product_attention over the valid cache prefix
     (GQA without copying K/V: enable_gqa);
  4. the LM head applied to the last position only;
  5. one-token projections as matrix-vector products, by the GEMV below (`gemv=`):
       "linear"    F.linear with one row: a GEMM kernel with M = 1 (the baseline's call);
       "mv"        torch.mv: the BLAS GEMV kernel (MKL for fp32, oneDNN for bf16 on CPU);
       "compiled"  the GEMV written as what it is, a row-wise dot product (W * x).sum(-1) in
                   fp32, which torch.compile (Inductor) turns into ONE vectorised, threaded
                   loop that reads each weight once. On the CPUs lesson 02 measures, the BLAS
                   GEMVs stream a 576-wide weight more slowly than this loop does;
       "auto"      "compiled" on CPU (falling back to "mv", with a warning, where no C++
                   compiler is found), "mv" on a GPU (cuBLAS's GEMV already streams at speed);
  6. the whole decode step of a layer compiled (`compiled_step=`, CPU): one token through one
     layer written as plain tensor math (row-wise dots, RoPE by cos/sin, attention as an explicit
     softmax over the cache prefix) that torch.compile turns into ONE generated kernel per layer.
     Every layer has the same shapes and the position becomes a symbolic int, so one compiled
     function serves all 30 layers and every step. What it removes: the ~15 small eager ops per
     layer (each a Python dispatch + a kernel launch), a large share of a step once item 5 is on;
  7. speculative verification compiled (`forward_verify`, CPU): the k + 1 tokens of a round of
     speculative decoding in ONE forward that returns the logits of ALL T = k + 1 positions, each
     layer ONE compiled call (`verify_layer`; T, the position and the cache length symbolic, so one
     graph serves every T >= 2, step and sequence). Its projections stay torch.mm on the (out, in)
     weights: no formulation measured here beat it at small T. On the 2-core Xeon (the 30 layers'
     matrices, fp32, T = 1 / 5 / 9 / 17): torch.mm 22 / 39 / 45 / 52 ms (MKL's small-M GEMM is
     far from the memory bound), oneDNN's no better, MKL on a pre-packed copy (424 MB more)
     24 / 41 / 32 / -, the row-wise form with T accumulators 30 / 42 (T = 4) / 48 / 82, Inductor's
     CPP GEMM template only for constant (frozen, packed: copied) weights; in bf16 torch.mm
     (oneDNN, AMX) takes ~23 ms at any T. So a verification costs ~1.7 decode steps at T = 5 and
     ~2 at T = 9 in fp32, ~1.3 in bf16.

  8. quantised weights in the compiled step (`quantized_step_ready`, `forward_quantized`, CPU): for
     a model whose projections are int8 or int 3/4-bit QuantLinears, the step of item 6 multiplies by
     the packed weights with torch's int8 / int4 kernels (minillm/quant/cpu_kernels.py) where it would
     do a row-wise dot: the kernels read the codes and dequantise in registers, the graph around them
     is the same one generated loop per layer. wq/wk/wv and w_gate/w_up are stacked into one packed
     matrix each, as in item 1. A prompt runs kv_cache.forward_cached over the QuantLinears.

Tested token-identical to the baseline in fp32, for every gemv mode and with the compiled step,
and the verification step's logits against forward_cached's (tests/test_fast_decode.py).
"""
from __future__ import annotations

import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import transforms
from .kv_cache import KVCache
from .layer import compiled_rowwise_dot, compiler_errors, rowwise_dot as _rowwise_dot
from .model import Llama, attention_function, check_attention_backend
from .positions import RopeTable, apply_rope, apply_rope_complex


def fuse_projections(model: Llama) -> Llama:
    """transforms.fuse_projections (item 1), then is_fused's decode-weights snapshot for item 6."""
    transforms.fuse_projections(model)
    is_fused(model)
    return model


def is_fused(model: Llama) -> bool:
    """transforms.is_fused, and (NEW in this stage) re-takes model._decode_weights, the per-layer
    weights the compiled decode step reads (item 6): every caller of forward_fast checks is_fused
    once per sequence, so a projection replaced after fusing is seen before the next one."""
    model._decode_weights = None
    if not transforms.is_fused(model):
        return False
    model._decode_weights = _decode_weights(model)
    return True


def _decode_weights(model: Llama) -> list[tuple[torch.Tensor, ...]] | None:
    """Per layer (attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down) weights, detached (a Parameter
    would pin its shape in the compiled guards); collected once, not per step (30 layers x 10
    module lookups a step add up at batch 1). None where a projection has a bias or is not a plain Linear."""
    weights = []
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        linears = (attn.wqkv, attn.wo, ffn.w_gate_up, ffn.w_down)
        if any(type(m) is not nn.Linear or m.bias is not None for m in linears):
            return None
        weights.append((layer.attn_norm.weight.detach(), attn.wqkv.weight.detach(), attn.wo.weight.detach(),
                        layer.ffn_norm.weight.detach(), ffn.w_gate_up.weight.detach(), ffn.w_down.weight.detach()))
    return weights


def quantized_step_ready(model: Llama) -> bool:
    """Item 8: for a model whose projections are QuantLinears with CPU kernels (int8, or int 3/4-bit
    without act-order; minillm/quant/cpu_kernels.py), set model._decode_weights to packed weights that
    the compiled decode step (item 6) multiplies by in place of its row-wise dots: (weight, scale,
    group) per projection, wq/wk/wv and w_gate/w_up stacked into one call each, in the model's dtype.
    Built once and reused while no stored tensor changes; False (and None) where any projection has
    no kernel: that model runs kv_cache.forward_cached. Called once per sequence, like is_fused."""
    from .quant import cpu_kernels
    from .quant.linear import QuantLinear

    model._decode_weights = None
    if not cpu_kernels._enabled:                                         # inside cpu_kernels.reference_path()
        return False
    dtype = model.embed.weight.dtype
    layers = [(b.attn.wq, b.attn.wk, b.attn.wv, b.attn.wo, b.ffn.w_gate, b.ffn.w_up, b.ffn.w_down)
              for b in model.layers]
    if model.embed.weight.device.type != "cpu" or not all(type(m) is QuantLinear for ls in layers for m in ls):
        return False
    source = (dtype, tuple((id(m), *((t.data_ptr(), t._version) for t in m._buffers.values()))
                           for ls in layers for m in ls))
    cached = getattr(model, "_quantized_step", None)
    if cached is None or cached[0] != source:
        weights = []
        for block, (wq, wk, wv, wo, w_gate, w_up, w_down) in zip(model.layers, layers):
            packs = (cpu_kernels.fused_pack([wq, wk, wv], dtype), cpu_kernels.fused_pack([wo], dtype),
                     cpu_kernels.fused_pack([w_gate, w_up], dtype), cpu_kernels.fused_pack([w_down], dtype))
            if any(p is None for p in packs):
                weights = None
                break
            weights.append((block.attn_norm.weight.detach(), packs[0], packs[1], block.ffn_norm.weight.detach(),
                            packs[2], packs[3]))
        model._quantized_step = cached = (source, weights)
    model._decode_weights = cached[1]
    return cached[1] is not None


GEMV_MODES = ("auto", "compiled", "mv", "linear")


# Default (automatic) dynamic shapes: compiled for the exact shapes first; a size seen to change
# is made symbolic in one recompile. Weight shapes never change, so the loops over them keep
# static trip counts (faster than dynamic=True's all-symbolic code; lesson 02 has the numbers).
_compiled_dot = compiled_rowwise_dot
_compiler_broken: str | None = None      # why compiling is unavailable; process-wide: the toolchain is the machine's


def _run_compiled(compiled, eager, *args):
    """compiled(*args); where torch.compile cannot build (no C++ compiler), warn once and from
    then on run eager(*args): the same math, unfused."""
    global _compiler_broken
    if _compiler_broken is None:
        try:
            return compiled(*args)
        except compiler_errors() as e:                                   # any other error is the step's own
            _compiler_broken = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"
            warnings.warn(f"torch.compile could not build the CPU decode kernels ({_compiler_broken}); "
                          "running them eagerly")
    return eager(*args)


def resolve_gemv(gemv: str, device) -> str:
    """The GEMV mode that will actually run: "auto" picks per device (and "mv" once compiling has
    failed here); "compiled" needs a CPU tensor (else a clear error)."""
    if gemv not in GEMV_MODES:
        raise ValueError(f"gemv = {gemv!r}; allowed: {', '.join(map(repr, GEMV_MODES))}")
    on_cpu = torch.device(device).type == "cpu"
    if gemv == "auto":
        return "compiled" if on_cpu and _compiler_broken is None else "mv"
    if gemv == "compiled" and not on_cpu:
        raise ValueError("gemv='compiled' is the CPU GEMV; on a GPU use 'mv' or 'auto'")
    return gemv


def gemv_compiled(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """_rowwise_dot compiled (weight (out, in), x (in,) -> (out,)). Detached and base-less inputs:
    a Parameter would pin its shape in the compiled guards, a view would add its base's."""
    return _run_compiled(_compiled_dot, torch.mv, weight.detach(), x.detach().clone())


def _gemv(weight: torch.Tensor, x: torch.Tensor, gemv: str) -> torch.Tensor:
    """weight (out, in) @ x (in,) -> (out,) by the chosen kernel: "compiled" or "mv"."""
    return gemv_compiled(weight, x) if gemv == "compiled" else torch.mv(weight, x)


def linear(module: nn.Module, x: torch.Tensor, gemv: str = "mv") -> torch.Tensor:
    """module(x); but a single row x (one decode token) through a plain nn.Linear runs as a
    matrix-vector product (gemv: "mv" or "compiled", see item 5; "linear" = module(x))."""
    if gemv != "linear" and type(module) is nn.Linear and x.numel() == module.in_features:
        y = _gemv(module.weight, x.reshape(-1), gemv)                     # (out,)
        if module.bias is not None:
            y = y + module.bias
        return y.view(*x.shape[:-1], -1)
    return module(x)


def lm_head(model: Llama, h: torch.Tensor, gemv: str = "mv") -> torch.Tensor:
    """model.logits(h), with the one-row case as a GEMV (the LM head is the largest matrix)."""
    if gemv != "linear" and model.lm_head is None and h.numel() == h.shape[-1]:
        logits = _gemv(model.embed.weight, model.norm(h).reshape(-1), gemv)  # (V,)
        return logits.view(*h.shape[:-1], -1)
    return model.logits(h)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model.RMSNorm's forward as one fused kernel (same math: x / rms(x) * weight)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def _project(w, x: torch.Tensor) -> torch.Tensor:
    """w @ x for x (in,) -> (out,): a float weight (out, in) by the row-wise dot, or a packed one
    (weight, scale, group) by its int8/int4 kernel (item 8)."""
    if isinstance(w, tuple):
        from .quant.cpu_kernels import packed_mm
        return packed_mm(x[None], *w)[0]
    return _rowwise_dot(w, x)


def _project_rows(x: torch.Tensor, w) -> torch.Tensor:
    """x (T, in) @ w^T -> (T, out), float or packed as in _project."""
    if isinstance(w, tuple):
        from .quant.cpu_kernels import packed_mm
        return packed_mm(x, *w)
    return x @ w.t()


def decode_layer(h: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor,
                 ffn_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor,
                 pos: int, n_heads: int, eps: float) -> torch.Tensor:
    """Item 6: ONE decode token through ONE layer, the same math as forward_fast's loop body,
    written for torch.compile: no module calls, GEMVs as row-wise dots, RoPE by cos/sin (Inductor
    does not generate complex arithmetic), attention as an explicit softmax over the valid prefix.
    h (dim,) -> (dim,); k_cache, v_cache (Hkv, max_len, D): this layer's cache, written at pos;
    cos_sin (D/2, 2): the rotation at pos."""
    Hkv, _, D = k_cache.shape
    Hq = n_heads
    x = F.rms_norm(h, attn_norm.shape, attn_norm, eps)                    # (dim,)
    qk, v = _project(wqkv, x).split([(Hq + Hkv) * D, Hkv * D])           # ((Hq+Hkv)*D,), (Hkv*D,)
    cos, sin = cos_sin.unbind(-1)                                         # (D/2,) each
    qk = apply_rope(qk.view(Hq + Hkv, D), cos, sin)                       # (Hq+Hkv, D)
    q, k = qk.split([Hq, Hkv])                                            # (Hq, D), (Hkv, D)
    k_cache.narrow(1, pos, 1).copy_(k.view(Hkv, 1, D))                    # narrow: pos stays symbolic
    v_cache.narrow(1, pos, 1).copy_(v.view(Hkv, 1, D))
    keys = k_cache.narrow(1, 0, pos + 1).float()                          # (Hkv, L, D)
    values = v_cache.narrow(1, 0, pos + 1).float()                        # (Hkv, L, D)
    q = q.float().view(Hkv, Hq // Hkv, D)                                 # (Hkv, G, D): GQA, K/V not copied
    scores = (q[:, :, None] * keys[:, None]).sum(-1) * D ** -0.5          # (Hkv, G, L)
    out = (scores.softmax(-1)[..., None] * values[:, None]).sum(-2)       # (Hkv, G, D)
    h = h + _project(wo, out.reshape(Hq * D).to(h.dtype))
    gate, up = _project(w_gate_up, F.rms_norm(h, ffn_norm.shape, ffn_norm, eps)).chunk(2)  # (ffn,) each
    return h + _project(w_down, F.silu(gate) * up)


# All layers have the same shapes, so one compiled step serves the 30 layers; pos changes at the
# second step and becomes symbolic (one recompile): from then on one graph serves every step.
_compiled_decode_layer = torch.compile(decode_layer)
# For 2-byte weights, a second build: by default Inductor inlines the normalised input (RMSNorm) into
# each GEMV loop and recomputes it, with the bf16 -> fp32 conversions, for every ROW. Materialising any
# pointwise result of more than 2 ops once (in fp32) makes the GEMV loop a bare load-convert-multiply-add.
# Which build is faster depends on the CPU (lesson 02: the materialised one on the Intel Xeon VM, the
# default one, by 2x, on the AMD EPYC VM), so the first 2-byte decode step of each model shape in a
# process times both (choose_16bit_build) and keeps the faster; fp32 always takes the default build.
try:
    _compiled_decode_layer_16bit = torch.compile(decode_layer, options={"realize_opcount_threshold": 2})
except RuntimeError:                      # options are checked here, at import: an Inductor without it
    _compiled_decode_layer_16bit = _compiled_decode_layer
BUILDS_16BIT = ("default", "materialised")
_chosen_16bit: dict[str, str] = {}        # "float|packed dim=D layers=L" -> the build chosen in this process
CHOICE_ROUNDS = 3


def _build(name: str):
    return _compiled_decode_layer if name == "default" else _compiled_decode_layer_16bit


def choose_16bit_build(kind: str, run_layers) -> str:
    """The faster 2-byte build for this machine, timed once per process and graph kind (float or packed
    weights, and the model's shape: a tiny model's choice says nothing about a real one). run_layers(build)
    runs the first decode step's layers with that build: a whole step, so that the weights stream from
    memory as they do in use (one layer timed alone sits in the cache, and there the two builds tie).
    Rewriting that step's K/V is harmless: the step itself runs afterwards and writes its own. Each build
    runs once to compile, then CHOICE_ROUNDS alternating timed rounds; the lower total wins. Where
    compiling fails, nothing is timed."""
    if kind not in _chosen_16bit:
        for name in BUILDS_16BIT:                                          # compile both
            run_layers(_build(name))
        totals = dict.fromkeys(BUILDS_16BIT, 0.0)
        for _ in range(CHOICE_ROUNDS if _compiler_broken is None else 0):
            for name in BUILDS_16BIT:
                t0 = time.perf_counter()
                run_layers(_build(name))
                totals[name] += time.perf_counter() - t0
        _chosen_16bit[kind] = min(BUILDS_16BIT, key=totals.get)
    return _chosen_16bit[kind]


def chosen_16bit_builds() -> dict[str, str]:
    """What choose_16bit_build picked in this process (benchmarks write it into their JSON)."""
    return dict(_chosen_16bit)


def can_compile_step(model: Llama, device) -> bool:
    """Item 6 applies on CPU to a model whose is_fused() found bias-free plain projections."""
    return torch.device(device).type == "cpu" and getattr(model, "_decode_weights", None) is not None


def _decode_compiled(model: Llama, token: torch.Tensor, cache: KVCache, rope: RopeTable, pos: int) -> torch.Tensor:
    """token (1, 1) at position pos -> logits (1, V): each layer by the compiled decode_layer
    (decode_layer itself, eagerly, where compiling fails)."""
    cfg = model.cfg
    h = model.embed.weight.detach()[int(token)].clone()                   # (dim,) not a view: layer 0
                                                                          # then matches the others' guards
    cos_sin = torch.view_as_real(rope.rotation[pos])                      # (D/2, 2)
    k_layers, v_layers = cache.k[:, 0].unbind(0), cache.v[:, 0].unbind(0)  # L x (Hkv, max_len, D) views

    def run_layers(compiled, h=h):
        for weights, k_cache, v_cache in zip(model._decode_weights, k_layers, v_layers):
            h = _run_compiled(compiled, decode_layer, h, *weights, k_cache, v_cache, cos_sin, pos, cfg.n_heads,
                              cfg.norm_eps)
        return h

    compiled = _compiled_decode_layer
    if h.element_size() == 2:
        kind = "packed" if isinstance(model._decode_weights[0][1], tuple) else "float"
        kind = f"{kind} dim={cfg.dim} layers={cfg.n_layers}"
        compiled = _build(choose_16bit_build(kind, run_layers))
    h = run_layers(compiled)
    cache.lengths[0] = pos + 1
    return lm_head(model, h.view(1, -1), "compiled")                     # (1, V); torch.mv if compiling failed


def verify_layer(h: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor,
                 ffn_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor,
                 pos: int, n_heads: int, eps: float) -> torch.Tensor:
    """Item 7: T tokens at positions pos .. pos+T-1 through ONE layer, the same math as
    forward_fast's loop body written for torch.compile: matmuls for the projections, RoPE by
    cos/sin, causal attention over the cache prefix with the T new keys written first.
    h (T, dim) -> (T, dim); k_cache, v_cache (Hkv, max_len, D): this layer's cache, written at
    pos .. pos+T-1; cos_sin (T, D/2, 2): the rotations at those positions."""
    T = h.shape[0]
    Hkv, _, D = k_cache.shape
    Hq = n_heads
    G = Hq // Hkv
    x = F.rms_norm(h, attn_norm.shape, attn_norm, eps)                    # (T, dim)
    qk, v = _project_rows(x, wqkv).split([(Hq + Hkv) * D, Hkv * D], dim=-1)  # (T, (Hq+Hkv)*D), (T, Hkv*D)
    cos, sin = cos_sin[:, None].unbind(-1)                                # (T, 1, D/2) each: one per position
    qk = apply_rope(qk.view(T, Hq + Hkv, D), cos, sin)                    # (T, Hq+Hkv, D)
    q, k = qk.split([Hq, Hkv], dim=1)                                     # (T, Hq, D), (T, Hkv, D)
    k_cache.narrow(1, pos, T).copy_(k.transpose(0, 1))                    # (Hkv, T, D) at pos..pos+T-1
    v_cache.narrow(1, pos, T).copy_(v.view(T, Hkv, D).transpose(0, 1))
    L = pos + T                                                           # keys: the prefix and the new T
    keys = k_cache.narrow(1, 0, L).float()                                # (Hkv, L, D) fp32 scores,
    values = v_cache.narrow(1, 0, L).float()                              # (Hkv, L, D) as in decode_layer
    # GQA as in minillm/gqa.py: a group's G query heads folded into the row axis, K/V not copied
    q = q.float().view(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)  # (Hkv, G*T, D)
    scores = (q @ keys.transpose(1, 2)).view(Hkv, G, T, L) * D ** -0.5    # (Hkv, G, T, L)
    query_pos = pos + torch.arange(T, device=h.device)                    # (T,)
    visible = torch.arange(L, device=h.device) <= query_pos[:, None]      # (T, L) causal
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)       # (Hkv, G, T, L)
    out = (probs.view(Hkv, G * T, L) @ values).view(Hkv, G, T, D)         # (Hkv, G, T, D)
    h = h + _project_rows(out.permute(2, 0, 1, 3).reshape(T, Hq * D).to(h.dtype), wo)
    gate, up = _project_rows(F.rms_norm(h, ffn_norm.shape, ffn_norm, eps), w_gate_up).chunk(2, dim=-1)  # (T, ffn) each
    return h + _project_rows(F.silu(gate) * up, w_down)


# T and the cache length are marked dynamic (forward_verify) and pos becomes symbolic at the second
# step (one recompile): from then on one graph serves every T >= 2 at every position, for every
# sequence. Weight shapes stay static, as in decode_layer. One function for both dtypes (a graph each).
_compiled_verify_layer = torch.compile(verify_layer)


@torch.no_grad()
def forward_verify(model: Llama, tokens: torch.Tensor, cache: KVCache, rope: RopeTable) -> torch.Tensor:
    """tokens (1, T) continuing one sequence at cache.lengths[0] -> logits of ALL T positions (T, V),
    each layer by the compiled verify_layer (item 7; verify_layer itself, eagerly, where compiling
    fails). Same contract as kv_cache.forward_cached(..., all_logits=True)[0] for batch 1; the
    model must pass can_compile_step (a fused CPU model, checked by is_fused once per sequence)."""
    B, T = tokens.shape
    if B != 1:
        raise ValueError("forward_verify is the batch-1 path; use kv_cache.forward_cached for batches")
    if not can_compile_step(model, tokens.device):
        raise ValueError("forward_verify needs a CPU model with bias-free fused projections (checked by "
                         "is_fused); use kv_cache.forward_cached(..., all_logits=True) otherwise")
    cfg = model.cfg
    start = int(cache.lengths[0])
    if start + T > cache.max_len:
        raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {start + T}")
    if T == 1:                                 # one token: the compiled decode step IS this step
        return _decode_compiled(model, tokens, cache, rope, start)       # (1, V)
    h = model.embed.weight.detach()[tokens[0]]                            # (T, dim) gathered: not a view
    cos_sin = torch.view_as_real(rope.rotation[start:start + T])          # (T, D/2, 2)
    k_layers, v_layers = cache.k[:, 0].unbind(0), cache.v[:, 0].unbind(0)  # L x (Hkv, max_len, D) views
    # Sizes that vary (T per step, max_len per sequence) are symbolic from the first compile, not one
    # recompile each; layer 0's inputs are the ones a (re)compile sees.
    for tensor, dim in ((h, 0), (cos_sin, 0), (k_layers[0], 1), (v_layers[0], 1)):
        torch._dynamo.maybe_mark_dynamic(tensor, dim)
    for weights, k_cache, v_cache in zip(model._decode_weights, k_layers, v_layers):
        h = _run_compiled(_compiled_verify_layer, verify_layer, h, *weights, k_cache, v_cache, cos_sin, start,
                          cfg.n_heads, cfg.norm_eps)
    cache.lengths[0] = start + T
    return model.logits(h)                                                # (T, V)


@torch.no_grad()
def forward_quantized(model: Llama, tokens: torch.Tensor, cache: KVCache, rope: RopeTable) -> torch.Tensor:
    """Batch 1 on a quantised model that passed quantized_step_ready (item 8): a decode token by the
    compiled decode step over the packed weights, a prompt by kv_cache.forward_cached (its
    QuantLinears pick their kernel or the reference path). tokens (1, T) -> logits (1, V)."""
    if tokens.shape[0] != 1:
        raise ValueError("forward_quantized is the batch-1 path; use kv_cache.forward_cached for batches")
    if tokens.shape[1] == 1 and can_compile_step(model, tokens.device):
        start = int(cache.lengths[0])
        if start + 1 > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {start + 1}")
        return _decode_compiled(model, tokens, cache, rope, start)
    from .kv_cache import forward_cached
    return forward_cached(model, tokens, cache)


@torch.no_grad()
def forward_fast(model: Llama, tokens: torch.Tensor, cache: KVCache, rope: RopeTable,
                 attention_backend: str = "sdpa", gemv: str = "auto",
                 compiled_step: bool | None = None) -> torch.Tensor:
    """tokens (1, T) continuing one sequence at cache.lengths[0] -> logits of the last token (1, V).
    Same contract as kv_cache.forward_cached for batch 1 (prefill T > 1 or decode T = 1). The model
    must be fused, and checked by is_fused() once per sequence (which generate_greedy_fast and
    LLM do).
    attention_backend: how a step with T > 1 attends (model.ATTENTION_BACKENDS: "naive", "sdpa",
    "flash"); a decode step is one query row and always uses torch's fused SDPA.
    gemv: how one-token projections run (item 5: "auto", "compiled", "mv", "linear").
    compiled_step: a decode step (T = 1) by the compiled decode_layer (item 6); None = where it
    applies (can_compile_step) and torch.compile works. A prefill always runs the loop below."""
    check_attention_backend(attention_backend)
    attend = attention_function(attention_backend if tokens.shape[1] > 1 else "sdpa")
    gemv = resolve_gemv(gemv, tokens.device)
    B, T = tokens.shape
    if B != 1:
        raise ValueError("forward_fast is the batch-1 path; use kv_cache.forward_cached for batches")
    cfg = model.cfg
    Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    start = int(cache.lengths[0])
    end = start + T
    if end > cache.max_len:
        raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {end}")
    step_applies = can_compile_step(model, tokens.device)
    if compiled_step is None:
        compiled_step = step_applies and _compiler_broken is None
    if compiled_step and T == 1:
        if not step_applies:
            raise ValueError("compiled_step=True needs a CPU model with bias-free fused projections "
                             "(checked by is_fused)")
        return _decode_compiled(model, tokens, cache, rope, start)
    rotation = rope.rotation[start:end][None, :, None]                    # (1, T, 1, D/2) complex
    h = model.embed(tokens)                                               # (1, T, dim)
    for i, layer in enumerate(model.layers):
        qkv = linear(layer.attn.wqkv, rms_norm(layer.attn_norm, h), gemv)  # (1, T, (Hq+2Hkv)*D)
        qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
        qk = apply_rope_complex(qk.view(B, T, Hq + Hkv, D), rotation).transpose(1, 2)  # (1, Hq+Hkv, T, D)
        q, k = qk[:, :Hq], qk[:, Hq:]                                     # (1, Hq, T, D), (1, Hkv, T, D)
        cache.k[i, :, :, start:end] = k
        cache.v[i, :, :, start:end] = v.view(B, T, Hkv, D).transpose(1, 2)
        keys, values = cache.k[i, :, :, :end], cache.v[i, :, :, :end]     # (1, Hkv, end, D)
        out = attend(q, keys, values, causal=True)                        # (1, Hq, T, D): causal after start
        h = h + linear(layer.attn.wo, out.transpose(1, 2).reshape(B, T, Hq * D), gemv)
        gate, up = linear(layer.ffn.w_gate_up, rms_norm(layer.ffn_norm, h), gemv).chunk(2, dim=-1)  # (1, T, ffn) each
        h = h + linear(layer.ffn.w_down, F.silu(gate) * up, gemv)
    cache.lengths[0] = end
    return lm_head(model, h[:, -1], gemv)                                 # (1, V)


@torch.no_grad()
def generate_greedy_fast(model: Llama, prompt: list[int], max_new_tokens: int, gemv: str = "auto",
                         compiled_step: bool | None = None) -> list[int]:
    """Greedy batch-1 decoding on the fast path (fuses the model's projections if needed)."""
    if not is_fused(model):
        fuse_projections(model)
    device = model.embed.weight.device
    total = len(prompt) + max_new_tokens
    cache = KVCache(model.cfg, 1, total, model.embed.weight.dtype, device)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, total, device)
    logits = forward_fast(model, torch.tensor([prompt], device=device), cache, rope, gemv=gemv,
                          compiled_step=compiled_step)                    # (1, V)
    out = []
    for step in range(max_new_tokens):
        out.append(int(logits.argmax()))
        if step + 1 < max_new_tokens:
            logits = forward_fast(model, torch.tensor([[out[-1]]], device=device), cache, rope, gemv=gemv,
                                  compiled_step=compiled_step)
    return out
