"""QuantLinear's CPU fast path: multiply by the packed weight without ever building it in float.

The reference path (QuantLinear.forward_reference) unpacks every code, writes W (out, in) as
float32, casts it to the activation dtype and calls F.linear: per call it writes and reads a
full-precision copy of W, so a decode step moves more bytes than a float model would. Here,
torch's own CPU kernels (the ones gpt-fast runs) read the stored codes and dequantise inside
the dot-product loop, in registers; nothing the size of W is allocated:

    int8   torch._weight_int8pack_mm(x, q, s)                  y = (x @ q^T) * s
    int    torch._weight_int4pack_mm_for_cpu(x, Wp, g, so)     y = x @ ((q - 8) * s + o)^T

Bytes read per weight: int8 1 (+ one s per row); int 0.5 (+ one (s, o) pair per g weights: 4 bytes
in bf16, 8 in fp32). A bf16 weight is 2 bytes, fp32 4. The reference path, per call, reads the
packed codes and then writes and reads the unpacked codes (1 byte), W in fp32 (4) and W cast to the
activation dtype (2 for bf16): over 10 bytes of traffic per weight.

How our stored formats map onto the kernels, exactly:
  int8   q as stored (int8 (out, in)), s = scale (out,) in the activation dtype.
  int    the kernel's dequantisation is (q - 8) * s + o, one (s, o) pair per g columns of a row;
         ours is (q - z) * s, so o = (8 - z) * s, with z = 2^(bits-1) when symmetric. 3-bit codes
         (0..7) are valid 4-bit codes, so 3-bit layers run too (stored there at 4 bits a weight).
         The kernel accepts g in 32, 64, 128, 256 dividing in_features: our group G becomes G/g
         kernel groups sharing one (s, o) (SmolLM2's 576 = 4.5 x 128 runs as g = 64). GPTQ's
         act-order codes are in permuted column order: y = x[:, perm] @ W_perm^T, a gather of x.
  nf4    not here: its 16 levels are not evenly spaced, so it cannot be written as (q - 8) * s + o
         and stays on the reference path.

Precision (why tests/quant/test_quant_fast.py allows what it allows):
  fp32 x: s (fp16) and o = (8 - z) * s (<= 15 significant bits) are exact in fp32, so the kernel's
          weights are bit-identical to dequantize(); only the order of the sum differs.
  bf16 x: the kernels take s (and o) in bf16, each rounded by at most 2^-8 relative, where the
          reference rounds every weight to bf16 (also 2^-8). Equally close to the exact product,
          not bit-identical to each other.

Packing (the int4 kernel's tiled layout, scales in the activation dtype) happens once per layer and
activation dtype, on first use, and is cached on the module (_cpu_packs); it is rebuilt if a stored
tensor changes. The int4 pack is a second copy of the codes (0.5 byte a weight) beside the stored
ones, which save_quantized and the reference path read; int8 runs on the stored q itself.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from . import int4

# Activation dtypes the fast path takes, and the most rows (tokens) per call for which the kernel
# beat the reference path (dequantise, then F.linear) on the 2-core AVX512 Xeon where these limits were
# set (torch 2.13, SmolLM2's 30 x 7 linears): the bf16 kernels are AVX512 loops, several times faster
# at one row; past ~64 rows (a prefill), dequantising once and one bf16 GEMM win. The fp32 kernels
# are scalar loops, barely ahead at one row: only a single row gains. bench quant times both paths.
KERNEL_MAX_ROWS = {torch.bfloat16: 64, torch.float32: 1}
INT4_KERNEL_GROUPS = (256, 128, 64, 32)            # group sizes _weight_int4pack_mm_for_cpu accepts
INT4_ROW_BLOCK = 16                                # _convert_weight_to_int4pack_for_cpu packs 16 rows at a time
INT4_KERNEL_ZERO = 8                               # the code the int4 kernel subtracts: (q - 8) * s + o


@contextlib.contextmanager
def reference_path(model: torch.nn.Module):
    """Inside the block every QuantLinear of `model` (itself one, or any module holding them) takes
    the reference path on a CPU (dequantise, then F.linear): what the fast path is tested and
    benchmarked against. The switch is each layer's own use_cpu_kernel, restored on exit; an engine
    lays out its packs when it is built, so build the reference LLM's engine inside the block."""
    layers = [m for m in model.modules() if hasattr(m, "use_cpu_kernel")]
    before = [m.use_cpu_kernel for m in layers]
    for m in layers:
        m.use_cpu_kernel = False
    try:
        yield
    finally:
        for m, was in zip(layers, before):
            m.use_cpu_kernel = was


def unsupported(layer) -> str | None:
    """None if a kernel handles this layer's format and shape; else why it takes the reference path."""
    if layer.fmt == "int8":
        return None
    if layer.fmt == "nf4":
        return "NF4's 16 levels are not evenly spaced: no packed CPU kernel, the reference path runs"
    if layer.fmt == "w8a8":
        return "W8A8 runs its own int8 GEMM (quant/w8a8.py), not the weight-only kernels"
    if layer.fmt == "fp8":
        return "no FP8 GEMM on a CPU: the reference path dequantises the e4m3 weights"
    if kernel_group(layer.params["group_size"], layer.in_features) is None:
        return (f"group_size {layer.params['group_size']} and in_features {layer.in_features} share no "
                f"int4 kernel group size of {INT4_KERNEL_GROUPS}")
    if layer.out_features % INT4_ROW_BLOCK:
        return f"out_features {layer.out_features} is not a multiple of {INT4_ROW_BLOCK} (the int4 kernel's row block)"
    return None


def kernel_group(group_size: int, in_features: int) -> int | None:
    """The largest int4 kernel group size that divides both our group size and in_features."""
    return next((g for g in INT4_KERNEL_GROUPS if group_size % g == 0 and in_features % g == 0), None)


def applies(layer, x: torch.Tensor) -> bool:
    """The fast path runs for a CPU activation of a kernel dtype with at most KERNEL_MAX_ROWS rows,
    outside autograd (the kernels have no backward), on a layer whose format a kernel handles."""
    return (layer.use_cpu_kernel and layer.cpu_unsupported is None and x.device.type == "cpu" and not x.requires_grad
            and x.numel() <= KERNEL_MAX_ROWS.get(x.dtype, 0) * x.shape[-1])


# ---- packing: once per layer and activation dtype -------------------------------------------------

@dataclass(frozen=True)
class Packed:
    weight: torch.Tensor            # int8: q (out, in); int4: the kernel's tiled layout, uint8 (out, in/2)
    scale: torch.Tensor             # int8: s (out,); int4: (s, o) per kernel group, (in/g, out, 2)
    group: int                      # int4 kernel group size g (0 for int8)
    perm: torch.Tensor | None       # act-order column order of x (GPTQ), or None
    bias: torch.Tensor | None       # in the activation dtype
    source: tuple                   # (data_ptr, version) of the stored tensors it was built from


def packed(layer, dtype: torch.dtype) -> Packed:
    """The layer's weights in its kernel's layout, for activations of `dtype`; built on first use,
    and again if a stored tensor was replaced or written in place (its data_ptr or version moved)."""
    stored = (*layer._buffers.values(), *layer._parameters.values())       # codes, scales, ..., bias
    source = tuple((t.data_ptr(), t._version) for t in stored if t is not None)   # cheap: per call
    cached = layer._cpu_packs.get(dtype)
    if cached is None or cached.source != source:
        pack = pack_int8 if layer.fmt == "int8" else pack_int4
        bias = None if layer.bias is None else layer.bias.detach().to(dtype)
        cached = Packed(**pack(layer, layer.quantized_tensors(), dtype), bias=bias, source=source)
        layer._cpu_packs[dtype] = cached
    return cached


def pack_int8(layer, tensors: dict, dtype: torch.dtype) -> dict:
    return dict(weight=tensors["q"], scale=tensors["scale"].view(-1).to(dtype), group=0, perm=None)


def pack_int4(layer, tensors: dict, dtype: torch.dtype) -> dict:
    bits, group_size = layer.params["bits"], layer.params["group_size"]
    g = kernel_group(group_size, layer.in_features)
    codes = int4.unpack(tensors["packed"], bits)                             # (out, in) uint8, 0..2^bits-1
    weight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)  # (out, in/2) tiled
    scale = tensors["scale"].float()                                         # (out, ng)
    zero = tensors["zero"].float() if "zero" in tensors else torch.full_like(scale, 2 ** (bits - 1))
    offset = (INT4_KERNEL_ZERO - zero) * scale                               # (q - z) s = (q - 8) s + (8 - z) s
    per_group = torch.stack([scale, offset], dim=-1)                         # (out, ng, 2): exact in fp32
    per_kernel_group = per_group.repeat_interleave(group_size // g, dim=1)[:, :layer.in_features // g]
    scale_and_offset = per_kernel_group.transpose(0, 1).contiguous().to(dtype)  # (in/g, out, 2)
    perm = tensors["perm"].long() if "perm" in tensors else None
    return dict(weight=weight, scale=scale_and_offset, group=g, perm=perm)


# ---- the matmul --------------------------------------------------------------------------------

def packed_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """QuantLinear forward by a packed-weight kernel: x (..., in) -> (..., out) in x.dtype."""
    p = packed(layer, x.dtype)
    rows = x.reshape(-1, layer.in_features)                                  # (M, in): the kernels take 2-D
    if p.perm is not None:
        rows = rows[:, p.perm]                                               # (M, in) in the codes' column order
    rows = rows.contiguous()
    if p.group:
        y = torch._weight_int4pack_mm_for_cpu(rows, p.weight, p.group, p.scale)  # (M, out)
    else:
        y = torch._weight_int8pack_mm(rows, p.weight, p.scale)              # (M, out)
    if p.bias is not None:
        y = y + p.bias
    return y.view(*x.shape[:-1], layer.out_features)



# ---- fused packs for the compiled decode step (minillm/stages/fast_decode.py, item 8) --------------------

def fused_pack(layers: list, dtype: torch.dtype) -> tuple | None:
    """Layers that read the same input (wq, wk, wv; w_gate, w_up) as ONE kernel call: their packs
    stacked along the output dimension, as (weight, scale, group, perm) for packed_mm. GPTQ's act-order
    permutation comes from the input's statistics, so layers sharing an input share it. None where a
    layer has no kernel (NF4, shapes) or a bias, or the layers' formats or permutations differ."""
    first = layers[0]
    if any(l.cpu_unsupported is not None or l.bias is not None or l.fmt != first.fmt or l.params != first.params
           or l.in_features != first.in_features for l in layers):
        return None
    packs = [packed(l, dtype) for l in layers]
    perm = packs[0].perm
    if any((p.perm is None) != (perm is None) or (perm is not None and not torch.equal(p.perm, perm)) for p in packs):
        return None
    if first.fmt == "int8":
        return torch.cat([p.weight for p in packs]), torch.cat([p.scale for p in packs]), 0, perm
    codes = torch.cat([int4.unpack(l.packed, l.params["bits"]) for l in layers])   # (sum out, in) uint8
    weight = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)  # (sum out, in/2) tiled
    return weight, torch.cat([p.scale for p in packs], dim=1), packs[0].group, perm  # scale: (in/g, sum out, 2)


def packed_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group: int,
              perm: torch.Tensor | None = None) -> torch.Tensor:
    """x (M, in) @ the packed weight -> (M, out): group 0 is int8, else int4 with that group size;
    perm: the codes' column order (GPTQ act-order), applied to x."""
    if perm is not None:
        x = x[:, perm]                                                   # (M, in) in the codes' order
    if group:
        return torch._weight_int4pack_mm_for_cpu(x.contiguous(), weight, group, scale)
    return torch._weight_int8pack_mm(x.contiguous(), weight, scale)
