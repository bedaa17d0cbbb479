"""Fast batch-1 decode: the same math as kv_cache.forward_cached with the overhead taken out.

Lesson 02's teaching stage: one sequence on the contiguous cache (kv_cache.KVCache). The engine
never runs this file; it runs the same recipe on its own layer (model/runner.py, layer.py) and is
tested equal to it. Where this stage differs from kv_cache.forward_cached is marked # NEW.

    decoder = FastDecoder(model)            # once per model, after its load-time transforms
    logits = decoder.forward(tokens, cache, rope)      # (1, T) -> (1, V), prefill or decode
    logits = decoder.verify(tokens, cache, rope)       # (1, T) -> (T, V): every position (item 7)

At batch 1 a decode step must stream every weight once (lesson 01's bound); everything else
is overhead: one kernel launch + Python dispatch per small op, per layer. What this adds:

  1. fused projections: q, k, v come from ONE matrix [wq; wk; wv] and gate, up from ONE
     [w_gate; w_up]: 5 GEMVs per layer become 2 (fewer launches, longer contiguous reads);
     the original modules' weights become views into the fused ones, so nothing is copied
     and the naive model still runs on the very same numbers (transforms.fuse_projections, done
     once at load time; transforms.is_fused only looks);
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
       "auto"      "compiled" on CPU, "mv" on a GPU (cuBLAS's GEMV already streams at speed).
                   Where torch.compile cannot build (no C++ compiler) the decoder warns once,
                   records why in decoder.compile_failed and runs torch.mv from then on;
  6. the whole decode step of a layer compiled (`compiled_step=`, CPU): one token through one
     layer written as plain tensor math (row-wise dots, RoPE by cos/sin, attention as an explicit
     softmax over the cache prefix) that torch.compile turns into ONE generated kernel per layer.
     Every layer has the same shapes and the position becomes a symbolic int, so one compiled
     function serves all 30 layers and every step. What it removes: the ~15 small eager ops per
     layer (each a Python dispatch + a kernel launch), a large share of a step once item 5 is on.
     The per-layer weights it reads are collected once, when the FastDecoder is built (a model
     changed afterwards needs a new FastDecoder). For 2-byte weights there are two builds of it
     (BUILDS_16BIT); which is faster depends on the CPU, so it is given (`build=`), or timed once
     by FastDecoder.tune() and recorded in decoder.build; otherwise the recorded default;
  7. speculative verification compiled (`FastDecoder.verify`, CPU): the k + 1 tokens of a round of
     speculative decoding in ONE forward that returns the logits of ALL T = k + 1 positions, each
     layer ONE compiled call (`verify_layer`; T, the position and the cache length symbolic, so one
     graph serves every T >= 2, step and sequence). Its projections stay torch.mm on the (out, in)
     weights: no formulation measured here beat it at small T. On lesson 02's 2-core Xeon (the 30
     layers' matrices, fp32, T from 1 to 17) MKL's small-M GEMM is far from the memory bound, yet
     neither oneDNN, nor MKL on a pre-packed copy (a second copy of the weights), nor the row-wise
     form with T accumulators was faster across T, and Inductor's CPP GEMM template takes only
     constant (frozen, packed: copied) weights; in bf16 torch.mm (oneDNN, AMX) takes about the same
     time at any T. So a verification costs between one and two decode steps (bench speculative
     measures rounds of it).

  8. quantised weights in the compiled step (`quant_kernels=`, CPU): for a model whose projections
     are int8 or int 3/4-bit QuantLinears, the step of item 6 multiplies by the packed weights with
     torch's int8 / int4 kernels (minillm/quant/cpu_kernels.py) where it would do a row-wise dot:
     the kernels read the codes and dequantise in registers, the graph around them is the same one
     generated loop per layer. wq/wk/wv and w_gate/w_up are stacked into one packed matrix each, as
     in item 1, once, when the FastDecoder is built. A prompt runs kv_cache.forward_cached over the
     QuantLinears. quant_kernels=False (or a projection without a kernel): forward_cached throughout.

Tested token-identical to the baseline in fp32, for every gemv mode and with the compiled step,
and the verification step's logits against forward_cached's (tests/stages/test_fast_decode.py).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.layer import compile_on_first_call, compiled_or_eager, rowwise_dot as _rowwise_dot
from minillm.model.llama import Llama, attention_function, check_attention_backend
from minillm.model.positions import RopeTable, apply_rope, apply_rope_complex
from minillm.model.transforms import fuse_projections, is_fused  # noqa: F401  item 1: load-time transforms (pure), re-exported
from .kv_cache import KVCache, forward_cached

GEMV_MODES = ("auto", "compiled", "mv", "linear")
KINDS = ("float", "packed", "baseline")       # what a FastDecoder runs: see FastDecoder


# ---- the weights the compiled step reads (items 6 and 8): collected once, when a decoder is built ----

def float_decode_weights(model: Llama) -> list[tuple[torch.Tensor, ...]] | None:
    """Per layer (attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down) weights of a fused model, detached (a
    Parameter would pin its shape in the compiled guards); collected once, not per step (30 layers x 10
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


def packed_decode_weights(model: Llama) -> list[tuple] | None:
    """Item 8: for a CPU model whose projections are all QuantLinears with CPU kernels (int8, or int 3/4-bit;
    minillm/quant/cpu_kernels.py), per layer the weights the compiled step multiplies by in place of its
    row-wise dots: a packed (weight, scale, group, perm) per projection, wq/wk/wv and w_gate/w_up stacked
    into one call each, in the model's dtype. None where any projection has no kernel, or is switched to
    its reference path (quant.cpu_kernels.reference_path): that model runs kv_cache.forward_cached.
    Packing costs real time (int4: unpack and re-tile): build it once per model."""
    from minillm.quant import cpu_kernels
    from minillm.quant.linear import QuantLinear

    dtype = model.embed.weight.dtype
    layers = [(b.attn.wq, b.attn.wk, b.attn.wv, b.attn.wo, b.ffn.w_gate, b.ffn.w_up, b.ffn.w_down)
              for b in model.layers]
    if model.embed.weight.device.type != "cpu" or not all(type(m) is QuantLinear and m.use_cpu_kernel
                                                          for ls in layers for m in ls):
        return None
    weights = []
    for block, (wq, wk, wv, wo, w_gate, w_up, w_down) in zip(model.layers, layers):
        packs = (cpu_kernels.fused_pack([wq, wk, wv], dtype), cpu_kernels.fused_pack([wo], dtype),
                 cpu_kernels.fused_pack([w_gate, w_up], dtype), cpu_kernels.fused_pack([w_down], dtype))
        if any(p is None for p in packs):
            return None
        weights.append((block.attn_norm.weight.detach(), packs[0], packs[1], block.ffn_norm.weight.detach(),
                        packs[2], packs[3]))
    return weights


# ---- item 5: the GEMV ---------------------------------------------------------------------------------

def resolve_gemv(gemv: str, device) -> str:
    """The GEMV mode that will run: "auto" picks per device; "compiled" needs a CPU tensor (else a
    clear error). A pure function of its arguments: a compiler failure is the decoder's record."""
    if gemv not in GEMV_MODES:
        raise ValueError(f"gemv = {gemv!r}; allowed: {', '.join(map(repr, GEMV_MODES))}")
    on_cpu = torch.device(device).type == "cpu"
    if gemv == "auto":
        return "compiled" if on_cpu else "mv"
    if gemv == "compiled" and not on_cpu:
        raise ValueError("gemv='compiled' is the CPU GEMV; on a GPU use 'mv' or 'auto'")
    return gemv


# Default (automatic) dynamic shapes: compiled for the exact shapes first; a size seen to change
# is made symbolic in one recompile. Weight shapes never change, so the loops over them keep
# static trip counts (faster than dynamic=True's all-symbolic code; lesson 02 has the numbers).
_compiled_dot = compile_on_first_call(_rowwise_dot)


def gemv_compiled(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """_rowwise_dot compiled (weight (out, in), x (in,) -> (out,)). Detached and base-less inputs:
    a Parameter would pin its shape in the compiled guards, a view would add its base's."""
    return _compiled_dot(weight.detach(), x.detach().clone())


def linear(module: nn.Module, x: torch.Tensor, gemv=torch.mv) -> torch.Tensor:
    """module(x); but a single row x (one decode token) through a plain nn.Linear runs as the
    matrix-vector product gemv(weight (out, in), x (in,)) -> (out,) (item 5); gemv None: module(x)."""
    if gemv is not None and type(module) is nn.Linear and x.numel() == module.in_features:
        y = gemv(module.weight, x.reshape(-1))                            # (out,)
        if module.bias is not None:
            y = y + module.bias
        return y.view(*x.shape[:-1], -1)
    return module(x)


def weights_only_step(model) -> None:
    """One token's worth of weight traffic and nothing else: every linear as the library's GEMV
    (torch.mv, see linear above) + the LM head: what the BLAS kernels deliver for decode's
    shapes (lesson 02's compiled GEMV can beat it where the BLAS GEMV is slow)."""
    x = torch.randn(1, model.cfg.dim, dtype=model.embed.weight.dtype)
    for layer in model.layers:
        for lin in (layer.attn.wq, layer.attn.wk, layer.attn.wv, layer.attn.wo):
            linear(lin, x if lin.in_features == x.shape[-1] else x.new_zeros(1, lin.in_features))
        g = linear(layer.ffn.w_gate, x)
        linear(layer.ffn.w_up, x)
        linear(layer.ffn.w_down, g)
    torch.mv(model.embed.weight, x[0])


def lm_head(model: Llama, h: torch.Tensor, gemv=torch.mv) -> torch.Tensor:
    """model.logits(h), with the one-row case through a tied head as gemv (the LM head is the largest
    matrix); gemv None: model.logits(h)."""
    if gemv is not None and model.lm_head is None and h.numel() == h.shape[-1]:
        logits = gemv(model.embed.weight, model.norm(h).reshape(-1))     # (V,)
        return logits.view(*h.shape[:-1], -1)
    return model.logits(h)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model.RMSNorm's forward as one fused kernel (same math: x / rms(x) * weight)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


# ---- items 6-8: one token (or T tokens) through one layer, written for torch.compile ------------------

def _project(w, x: torch.Tensor) -> torch.Tensor:
    """w @ x for x (in,) -> (out,): a float weight (out, in) by the row-wise dot, or a packed one
    (weight, scale, group, perm) by its int8/int4 kernel (item 8)."""
    if isinstance(w, tuple):
        from minillm.quant.cpu_kernels import packed_mm
        return packed_mm(x[None], *w)[0]
    return _rowwise_dot(w, x)


def _project_rows(x: torch.Tensor, w) -> torch.Tensor:
    """x (T, in) @ w^T -> (T, out), float or packed as in _project."""
    if isinstance(w, tuple):
        from minillm.quant.cpu_kernels import packed_mm
        return packed_mm(x, *w)
    return x @ w.t()


def decode_layer(h: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor,
                 ffn_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor,
                 pos: int, n_heads: int, eps: float) -> torch.Tensor:
    """Item 6: ONE decode token through ONE layer, the same math as FastDecoder._forward_loop's
    body, written for torch.compile: no module calls, GEMVs as row-wise dots, RoPE by cos/sin (Inductor
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


def verify_layer(h: torch.Tensor, attn_norm: torch.Tensor, wqkv: torch.Tensor, wo: torch.Tensor,
                 ffn_norm: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, cos_sin: torch.Tensor,
                 pos: int, n_heads: int, eps: float) -> torch.Tensor:
    """Item 7: T tokens at positions pos .. pos+T-1 through ONE layer, the same math as
    FastDecoder._forward_loop's body written for torch.compile: matmuls for the projections, RoPE by
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
    # GQA as in minillm/attention/gqa.py: a group's G query heads folded into the row axis, K/V not copied
    q = q.float().view(T, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * T, D)  # (Hkv, G*T, D)
    scores = (q @ keys.transpose(1, 2)).view(Hkv, G, T, L) * D ** -0.5    # (Hkv, G, T, L)
    query_pos = pos + torch.arange(T, device=h.device)                    # (T,)
    visible = torch.arange(L, device=h.device) <= query_pos[:, None]      # (T, L) causal
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)       # (Hkv, G, T, L)
    out = (probs.view(Hkv, G * T, L) @ values).view(Hkv, G, T, D)         # (Hkv, G, T, D)
    h = h + _project_rows(out.permute(2, 0, 1, 3).reshape(T, Hq * D).to(h.dtype), wo)
    gate, up = _project_rows(F.rms_norm(h, ffn_norm.shape, ffn_norm, eps), w_gate_up).chunk(2, dim=-1)  # (T, ffn) each
    return h + _project_rows(F.silu(gate) * up, w_down)


# All layers have the same shapes, so one compiled step serves the 30 layers; pos changes at the
# second step and becomes symbolic (one recompile): from then on one graph serves every step.
_compiled_decode_layer = compile_on_first_call(decode_layer)
# For 2-byte weights, a second build: by default Inductor inlines the normalised input (RMSNorm) into
# each GEMV loop and recomputes it, with the bf16 -> fp32 conversions, for every ROW. Materialising any
# pointwise result of more than 2 ops once (in fp32) makes the GEMV loop a bare load-convert-multiply-add.
# Which build is faster depends on the CPU (lesson 02: the materialised one on the Intel Xeon VM, the
# default one, by 2x, on the AMD EPYC VM), so a decoder takes the build it is given, or the one its
# tune() step timed faster, or DEFAULT_BUILD; fp32 always runs the default build.
_compiled_decode_layer_16bit = compile_on_first_call(decode_layer, options={"realize_opcount_threshold": 2},
                                                   fallback=_compiled_decode_layer)   # an Inductor without it
BUILDS_16BIT = ("default", "materialised")
DEFAULT_BUILD = "default"                 # the recorded default: a decoder neither given a build nor tuned
CHOICE_ROUNDS = 3                         # tune(): alternating timed rounds after one compiling round


def _build(name: str):
    """The compiled decode step of a 2-byte build (looked up when called: tests substitute stand-ins)."""
    return _compiled_decode_layer if name == "default" else _compiled_decode_layer_16bit


# T and the cache length are marked dynamic (FastDecoder.verify) and pos becomes symbolic at the second
# step (one recompile): from then on one graph serves every T >= 2 at every position, for every
# sequence. Weight shapes stay static, as in decode_layer. One function for both dtypes (a graph each).
_compiled_verify_layer = compile_on_first_call(verify_layer)


class FastDecoder:
    """Lesson 02's batch-1 forward for ONE model, built once. What runs is decided here, from what the
    model is, and kept on this object: nothing is planted on the model, nothing is chosen inside a step.

    kind            "float": a fused float model (items 1-7); "packed": int8/int4 QuantLinears with CPU
                    kernels (item 8); "baseline": anything else (also a model with QK-norm), run by
                    kv_cache.forward_cached
    gemv            the GEMV mode one-token projections run (item 5), resolved for the model's device
    decode_weights  per layer (attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down) as tensors (float) or
                    int8/int4 packs (packed): what the compiled step reads; None where it does not apply
                    (a GPU, a projection with a bias, a format without a CPU kernel, quant_kernels=False)
    compiled_step   a decode token runs the compiled step (item 6; None: wherever decode_weights exist)
    build           the compiled step's 2-byte build (BUILDS_16BIT): given, timed by tune(), or DEFAULT_BUILD
    build_timings   tune()'s seconds per build (None: not tuned)
    compile_failed  why torch.compile could not build here (None: it could); from then on the decoder
                    runs the same math eagerly (the loop below; torch.mv for the compiled GEMV)
    """

    def __init__(self, model: Llama, gemv: str = "auto", compiled_step: bool | None = None,
                 build: str | None = None, quant_kernels: bool = True, attention_backend: str = "sdpa"):
        """gemv: item 5's mode. compiled_step: True asks for item 6 (an error where it cannot apply).
        build: the 2-byte build of item 6 (None: DEFAULT_BUILD until tune() is called).
        quant_kernels: item 8 for a quantised model (False: forward_cached, the QuantLinears' own path).
        attention_backend: how a step with T > 1 attends (model.ATTENTION_BACKENDS); a decode step is one
        query row and always uses torch's fused SDPA."""
        check_attention_backend(attention_backend)
        if model.cfg.sliding_window is not None:
            raise ValueError("a sliding-window model (Mistral) runs on the engine (LLM); lesson 02's batch-1 stage "
                             "and its contiguous cache predate windows")
        device = model.embed.weight.device
        on_cpu = device.type == "cpu"
        self.model, self.attention_backend = model, attention_backend
        self.gemv = resolve_gemv(gemv, device)
        self.compile_failed: str | None = None
        if model.cfg.qk_norm:           # this stage predates QK-norm (Qwen3): the baseline runs such a model
            self.kind, self.decode_weights = "baseline", None
        elif is_fused(model):                                             # NEW: item 1, fused at load time
            self.kind = "float"
            self.decode_weights = float_decode_weights(model) if on_cpu else None
        else:
            self.decode_weights = packed_decode_weights(model) if quant_kernels and on_cpu else None
            self.kind = "baseline" if self.decode_weights is None else "packed"
        if compiled_step is None:
            compiled_step = self.decode_weights is not None
        elif compiled_step and self.decode_weights is None:
            raise ValueError("compiled_step=True needs a CPU model whose fused projections are bias-free nn.Linears, "
                             "or int8/int4 QuantLinears with CPU kernels; use compiled_step=None or False")
        self.compiled_step = bool(compiled_step)
        if build is not None and build not in BUILDS_16BIT:
            raise ValueError(f"build = {build!r}; allowed: None, {', '.join(map(repr, BUILDS_16BIT))}")
        self.build = DEFAULT_BUILD if build is None else build
        self.build_timings: dict[str, float] | None = None
        # how a one-token projection runs (item 5): None = the module itself (F.linear)
        self._one_row = {"linear": None, "mv": torch.mv}.get(self.gemv, self._compiled_gemv)

    @property
    def can_verify(self) -> bool:
        """verify() applies: the compiled step's weights exist (a CPU model, fused or packed)."""
        return self.decode_weights is not None

    # ---- compiling, and what happens where it cannot ------------------------------------------------
    def _run(self, compiled, eager, *args):
        """layer.compiled_or_eager, recording a compiler failure in self.compile_failed."""
        return compiled_or_eager(self, compiled, eager, *args)

    def _compiled_gemv(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._run(gemv_compiled, torch.mv, weight, x)             # NEW: item 5, torch.mv if it fails

    # ---- item 6: the compiled decode step, and its one timing step --------------------------------
    def _decode_layers(self, h: torch.Tensor, cache: KVCache, rope: RopeTable, pos: int, build: str) -> torch.Tensor:
        """h (dim,) at position pos through every layer by the compiled decode_layer of `build` (fp32:
        always the default build; decode_layer itself, eagerly, where compiling fails)."""
        cfg = self.model.cfg
        cos_sin = torch.view_as_real(rope.rotation[pos])                  # (D/2, 2)
        k_layers, v_layers = cache.k[:, 0].unbind(0), cache.v[:, 0].unbind(0)  # L x (Hkv, max_len, D) views
        compiled = _build(build) if h.element_size() == 2 else _compiled_decode_layer
        for weights, k_cache, v_cache in zip(self.decode_weights, k_layers, v_layers):
            h = self._run(compiled, decode_layer, h, *weights, k_cache, v_cache, cos_sin, pos, cfg.n_heads,
                          cfg.norm_eps)
        return h

    def _decode_compiled(self, token: torch.Tensor, cache: KVCache, rope: RopeTable, pos: int) -> torch.Tensor:
        """token (1, 1) at position pos -> logits (1, V): each layer by the compiled step (item 6)."""
        h = self.model.embed.weight.detach()[int(token)].clone()         # (dim,) not a view: layer 0
                                                                          # then matches the others' guards
        h = self._decode_layers(h, cache, rope, pos, self.build)
        cache.lengths[0] = pos + 1
        return lm_head(self.model, h.view(1, -1), self._compiled_gemv)   # (1, V); torch.mv if compiling failed

    def tune(self, rounds: int = CHOICE_ROUNDS) -> str:
        """Item 6's one timing step, explicit: for 2-byte weights, whole decode steps (every layer, so
        that the weights stream from memory as they do in use; one layer timed alone sits in the cache,
        where the two builds tie) with each build of BUILDS_16BIT on a scratch cache, each compiled
        first, then `rounds` alternating timed rounds; the lower total wins. Records self.build and
        self.build_timings and returns the build. fp32 weights, a decoder without the compiled step or
        a compiler that fails: nothing is timed and the build stays. Call it once, before decoding
        (the benchmarks do, and write decoder.build into their JSON); never called by a step."""
        if self.decode_weights is None or self.model.embed.weight.element_size() != 2:
            return self.build
        cfg, weight = self.model.cfg, self.model.embed.weight
        cache = KVCache(cfg, 1, 4, weight.dtype, weight.device)          # scratch: the timing writes only here
        rope = RopeTable(cfg.head_dim, cfg.rope_theta, 4, weight.device, cfg.rope_scaling)
        h = weight.detach()[0].clone()                                    # (dim,)

        def step(name):
            self._decode_layers(h, cache, rope, 2, name)

        for name in BUILDS_16BIT:                                          # compile both
            step(name)
        totals = dict.fromkeys(BUILDS_16BIT, 0.0)
        for _ in range(rounds if self.compile_failed is None else 0):
            for name in BUILDS_16BIT:
                t0 = time.perf_counter()
                step(name)
                totals[name] += time.perf_counter() - t0
        if self.compile_failed is None:
            self.build, self.build_timings = min(BUILDS_16BIT, key=totals.get), totals
        return self.build

    # ---- the forward: a prefill or a decode token, and item 7's verification ----------------------
    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, cache: KVCache, rope: RopeTable) -> torch.Tensor:
        """tokens (1, T) continuing one sequence at cache.lengths[0] -> logits of the last token (1, V).
        Same contract as kv_cache.forward_cached for batch 1 (prefill T > 1 or decode T = 1)."""
        B, T = tokens.shape
        if B != 1:
            raise ValueError("FastDecoder.forward is the batch-1 path; use kv_cache.forward_cached for batches")
        start = int(cache.lengths[0])
        if start + T > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {start + T}")
        if T == 1 and self.compiled_step and self.compile_failed is None:
            return self._decode_compiled(tokens, cache, rope, start)     # NEW: item 6 (8: packed weights)
        if self.kind != "float":
            return forward_cached(self.model, tokens, cache)              # a prompt of a quantised model
        return self._forward_loop(tokens, cache, rope, start)

    def _forward_loop(self, tokens: torch.Tensor, cache: KVCache, rope: RopeTable, start: int) -> torch.Tensor:
        """Items 1-5, op by op: kv_cache.forward_cached's loop on the fused projections."""
        cfg, model = self.model.cfg, self.model
        B, T = tokens.shape
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        end = start + T
        attend = attention_function(self.attention_backend if T > 1 else "sdpa")   # NEW: item 3
        gemv = self._one_row                                                        # NEW: item 5
        rotation = rope.rotation[start:end][None, :, None]                # NEW: item 2, (1, T, 1, D/2) complex
        h = model.embed(tokens)                                           # (1, T, dim)
        for i, layer in enumerate(model.layers):
            qkv = linear(layer.attn.wqkv, rms_norm(layer.attn_norm, h), gemv)  # NEW: item 1, (1, T, (Hq+2Hkv)*D)
            qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
            qk = apply_rope_complex(qk.view(B, T, Hq + Hkv, D), rotation).transpose(1, 2)  # (1, Hq+Hkv, T, D)
            q, k = qk[:, :Hq], qk[:, Hq:]                                 # (1, Hq, T, D), (1, Hkv, T, D)
            cache.k[i, :, :, start:end] = k
            cache.v[i, :, :, start:end] = v.view(B, T, Hkv, D).transpose(1, 2)
            keys, values = cache.k[i, :, :, :end], cache.v[i, :, :, :end]  # (1, Hkv, end, D)
            out = attend(q, keys, values, causal=True)                    # (1, Hq, T, D): causal after start
            h = h + linear(layer.attn.wo, out.transpose(1, 2).reshape(B, T, Hq * D), gemv)
            gate, up = linear(layer.ffn.w_gate_up, rms_norm(layer.ffn_norm, h), gemv).chunk(2, dim=-1)  # (1, T, ffn) each
            h = h + linear(layer.ffn.w_down, F.silu(gate) * up, gemv)
        cache.lengths[0] = end
        return lm_head(model, h[:, -1], gemv)                             # NEW: item 4, (1, V)

    @torch.no_grad()
    def verify(self, tokens: torch.Tensor, cache: KVCache, rope: RopeTable) -> torch.Tensor:
        """Item 7: tokens (1, T) continuing one sequence at cache.lengths[0] -> logits of ALL T positions
        (T, V), each layer by the compiled verify_layer (verify_layer itself, eagerly, where compiling
        fails). Same contract as kv_cache.forward_cached(..., all_logits=True)[0] for batch 1; needs
        can_verify (the compiled step's weights)."""
        B, T = tokens.shape
        if B != 1:
            raise ValueError("FastDecoder.verify is the batch-1 path; use kv_cache.forward_cached for batches")
        if not self.can_verify:
            raise ValueError("FastDecoder.verify needs a CPU model with bias-free fused projections (or int8/int4 "
                             "packs); use kv_cache.forward_cached(..., all_logits=True) otherwise")
        cfg = self.model.cfg
        start = int(cache.lengths[0])
        if start + T > cache.max_len:
            raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {start + T}")
        if T == 1:                                 # one token: the compiled decode step IS this step
            return self._decode_compiled(tokens, cache, rope, start)     # (1, V)
        h = self.model.embed.weight.detach()[tokens[0]]                   # (T, dim) gathered: not a view
        cos_sin = torch.view_as_real(rope.rotation[start:start + T])      # (T, D/2, 2)
        k_layers, v_layers = cache.k[:, 0].unbind(0), cache.v[:, 0].unbind(0)  # L x (Hkv, max_len, D) views
        # Sizes that vary (T per step, max_len per sequence) are symbolic from the first compile, not one
        # recompile each; layer 0's inputs are the ones a (re)compile sees.
        for tensor, dim in ((h, 0), (cos_sin, 0), (k_layers[0], 1), (v_layers[0], 1)):
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        for weights, k_cache, v_cache in zip(self.decode_weights, k_layers, v_layers):
            h = self._run(_compiled_verify_layer, verify_layer, h, *weights, k_cache, v_cache, cos_sin, start,
                          cfg.n_heads, cfg.norm_eps)
        cache.lengths[0] = start + T
        return self.model.logits(h)                                       # (T, V)

    @torch.no_grad()
    def generate_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Greedy batch-1 decoding of one prompt on a fresh contiguous cache."""
        weight = self.model.embed.weight
        total = len(prompt) + max_new_tokens
        cache = KVCache(self.model.cfg, 1, total, weight.dtype, weight.device)
        rope = RopeTable(self.model.cfg.head_dim, self.model.cfg.rope_theta, total, weight.device,
                             self.model.cfg.rope_scaling)
        logits = self.forward(torch.tensor([prompt], device=weight.device), cache, rope)   # (1, V)
        out = []
        for step in range(max_new_tokens):
            out.append(int(logits.argmax()))
            if step + 1 < max_new_tokens:
                logits = self.forward(torch.tensor([[out[-1]]], device=weight.device), cache, rope)
        return out


@torch.no_grad()
def generate_greedy_fast(model: Llama, prompt: list[int], max_new_tokens: int, gemv: str = "auto",
                         compiled_step: bool | None = None, build: str | None = None) -> list[int]:
    """Greedy batch-1 decoding on the fast path: fuses the model's projections if they are not (item 1,
    the load-time transform), then FastDecoder(model, gemv, compiled_step, build).generate_greedy. A
    decoder per call (it only collects references for a float model); keep one FastDecoder to tune its
    2-byte build once, or to decode a quantised model (packing costs time)."""
    if not is_fused(model):
        fuse_projections(model)
    return FastDecoder(model, gemv=gemv, compiled_step=compiled_step, build=build).generate_greedy(prompt,
                                                                                                  max_new_tokens)
