"""Fused 4-bit dequantise + matmul, in plain PyTorch: the twin of kernels/w4a16.py, same tiling.

    y (M, N) = x (M, K) @ W^T,   W (N, K) stored as packed 4-bit codes + one scale per group

Walk K in tiles of BLOCK_K columns, each inside one group. For a tile, load the packed bytes
(N, BLOCK_K/2): the high nibbles are the even columns, the low nibbles the odd columns. So instead
of interleaving them back, split x the same way and do two half-size products:

    acc += x[:, even] @ W_even^T + x[:, odd] @ W_odd^T          (fp32 accumulator)

W_even / W_odd are dequantised on the fly from the tile's codes and the group's scale (and zero
point, or the NF4 code table). The full-precision W never exists: on a GPU only the packed
bytes are read from memory, 4x fewer than fp16 weights, which is what decode is bound by.

A QuantLinear reaches the kernel through operands (its tensors in the matmul's terms) and
w4a16_linear; the tile width comes from minillm/kernel_args.py, shared with the kernel.
"""
from __future__ import annotations

import torch

from ..kernel_args import w4a16_tile_k


def dequant_tile(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, code: torch.Tensor | None) -> torch.Tensor:
    """codes (N, n) uint8 of one group, scale / zero (N,) -> weights (N, n) float32."""
    if code is not None:                                                     # NF4: table lookup
        return code[codes.long()] * scale.float()[:, None]
    z = zero.float()[:, None] if zero is not None else 8.0                   # symmetric: z = 2^(4-1)
    return (codes.float() - z) * scale.float()[:, None]


def w4a16_matmul_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                       code: torch.Tensor | None = None, *, group: int, block_k: int | None = None) -> torch.Tensor:
    """x (M, K), packed uint8 (N, K/2), scale (N, ceil(K/group)), zero like scale or None,
    code (16,) for NF4 or None -> y (M, N) in x.dtype."""
    M, K = x.shape
    N = packed.shape[0]
    block_k = block_k or w4a16_tile_k(group)
    acc = torch.zeros(M, N, dtype=torch.float32, device=x.device)            # (M, N)
    for k0 in range(0, K, block_k):
        k1 = min(k0 + block_k, K)
        byte = packed[:, k0 // 2:k1 // 2]                                    # (N, bk/2)
        g = k0 // group
        z = None if zero is None else zero[:, g]
        w_even = dequant_tile(byte >> 4, scale[:, g], z, code).to(x.dtype)   # (N, bk/2): columns k0, k0+2, ...
        w_odd = dequant_tile(byte & 0xF, scale[:, g], z, code).to(x.dtype)   # (N, bk/2): columns k0+1, k0+3, ...
        acc += x[:, k0:k1:2].float() @ w_even.float().T + x[:, k0 + 1:k1:2].float() @ w_odd.float().T
    return acc.to(x.dtype)


def operands(layer) -> dict:
    """A QuantLinear's tensors in the fused matmul's terms (group scales (N, ng), mode, permutation)."""
    if layer.fmt == "int" and layer.params["bits"] == 4:
        return dict(packed=layer.packed, scale=layer.scale, zero=getattr(layer, "zero", None), code=None,
                    group=layer.params["group_size"], perm=getattr(layer, "perm", None))
    if layer.fmt == "nf4":
        from .nf4 import NF4_CODE, block_absmax
        absmax = block_absmax(**{k: v for k, v in layer.quantized_tensors().items() if k != "packed"})
        block = layer.params["block"]
        return dict(packed=layer.packed, scale=absmax.view(layer.out_features, layer.in_features // block), zero=None,
                    code=NF4_CODE.to(absmax.device), group=block, perm=None)
    raise ValueError(f"the fused 4-bit matmul handles fmt 'int' with 4 bits and 'nf4'; got {layer.extra_repr()}")


def supports(layer) -> bool:
    if layer.fmt == "int":
        return layer.params["bits"] == 4 and layer.params["group_size"] % 32 == 0
    if layer.fmt == "nf4":
        return layer.params["block"] % 32 == 0 and layer.in_features % layer.params["block"] == 0
    return False


def w4a16_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """QuantLinear forward with the fused Triton kernel: x (..., in) -> (..., out)."""
    from kernels.w4a16 import w4a16_matmul

    ops = operands(layer)
    x2 = x.reshape(-1, x.shape[-1])                                  # (M, K)
    if ops["perm"] is not None:                                      # act-order codes: permute x instead of W
        x2 = x2[:, ops["perm"].long()]
    zero = ops["zero"]
    if zero is not None and zero.stride() != ops["scale"].stride():
        zero = zero.contiguous()
    y = w4a16_matmul(x2.contiguous(), ops["packed"], ops["scale"].contiguous(), zero, ops["code"], group=ops["group"])
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], -1)
