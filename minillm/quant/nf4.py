"""NF4 (QLoRA's 4-bit NormalFloat), stored exactly as bitsandbytes stores it.

Weights of a trained network are roughly normal. NF4 places its 16 levels at quantiles of a
normal distribution (rescaled to [-1, 1], with an exact 0), so every level is used about equally
often; uniform int4 spends levels on the sparse tails instead. Per block of 64 consecutive weights
(in the flattened, row-major tensor):

    absmax = max |w|,   q = index of the code nearest to w / absmax,   w ~= CODE[q] * absmax

Two codes per byte, first element in the high nibble. Ties (exactly between two codes) go to the
lower code, as in bitsandbytes.

Double quantisation: the fp32 absmax costs 32/64 = 0.5 bit per weight. QLoRA quantises the
absmax values too: subtract their mean, then quantise them in blocks of 256 to 8 bits with
bitsandbytes' "dynamic" 8-bit code (a signed float-like grid), keeping one fp32 scale per 256
absmax values: 8/64 + 32/(64*256) = 0.127 bit per weight.
"""
from __future__ import annotations

import torch

from .int4 import pack, unpack

NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)
ABSMAX_BLOCK = 256            # double quantisation: absmax values per 8-bit block


def dynamic_code_8bit() -> torch.Tensor:
    """bitsandbytes' signed 8-bit "dynamic" code (256 sorted values in [-1, 1]).

    A sign bit, then a run of zeros whose length is a decimal exponent (10^-6 .. 10^0), then a
    linear fraction in the bits that remain: small magnitudes get fine steps, large ones coarse.
    For exponent e = 0..6 the fraction has 2^e levels at the midpoints of linspace(0.1, 1, 2^e + 1);
    every level appears with both signs; 0 and +1 complete the 256 values."""
    values = []
    for e in range(7):
        edges = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)   # fraction boundaries
        mids = (edges[:-1] + edges[1:]) / 2.0                               # (2^e,) float32
        level = 10.0 ** (e - 6) * mids                                       # scaled in float32
        values += level.tolist() + (-level).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)               # (256,)


def quantize_blockwise(x: torch.Tensor, code: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat x (n,) -> codes uint8 (n,) (nearest entry of the sorted `code`), absmax fp32 (ceil(n/block),).
    A last partial block is quantised with its own absmax."""
    # BEGIN SOLUTION nf4_rtn
    n = x.numel()
    padded = torch.nn.functional.pad(x.float(), (0, (-n) % block))      # zeros do not change an absmax
    blocks = padded.view(-1, block)                                      # (nb, block)
    absmax = blocks.abs().amax(dim=1)                                    # (nb,)
    # multiply by the reciprocal (not divide): this is what bitsandbytes computes, bit for bit
    scaled = torch.clamp(blocks * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)[:n]
    midpoints = (code[:-1] + code[1:]) / 2                               # decision boundaries
    q = torch.searchsorted(midpoints.to(x.device), scaled)               # count of midpoints < value
    return q.to(torch.uint8), absmax
    # END SOLUTION


def dequantize_blockwise(q: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor, block: int) -> torch.Tensor:
    """codes (n,) -> code[q] * absmax of its block, float32 (n,)."""
    # BEGIN SOLUTION nf4_rtn
    n = q.numel()
    values = code.to(q.device)[q.long()]                                  # (n,)
    values = torch.nn.functional.pad(values, (0, (-n) % block)).view(-1, block)
    return (values * absmax[:, None]).reshape(-1)[:n]
    # END SOLUTION


def quantize(w: torch.Tensor, block: int = 64, double_quant: bool = False) -> dict:
    """W (out, in) -> {"packed": uint8 (out, in/2), absmax (fp32) or its double-quantised form}."""
    if not isinstance(block, int) or block <= 0 or w.numel() % block:
        raise ValueError(f"NF4 block = {block!r} is invalid for a weight of {w.numel()} values; "
                         f"allowed: a positive divisor of the number of weights (64 is the standard)")
    if w.shape[-1] % 2:
        raise ValueError(f"NF4 packs two values per byte: in_features ({w.shape[-1]}) must be even")
    codes, absmax = quantize_blockwise(w.reshape(-1), NF4_CODE.to(w.device), block)  # (n,), (n/block,)
    tensors = {"packed": pack(codes.view(w.shape), 4)}
    if not double_quant:
        tensors["absmax"] = absmax
        return tensors
    offset = absmax.mean()
    absmax_q, absmax_scale = quantize_blockwise(absmax - offset, dynamic_code_8bit(), ABSMAX_BLOCK)
    tensors.update(absmax_q=absmax_q, absmax_scale=absmax_scale, absmax_offset=offset.reshape(1))
    return tensors


def block_absmax(absmax=None, absmax_q=None, absmax_scale=None, absmax_offset=None) -> torch.Tensor:
    """The fp32 absmax per block, undoing double quantisation when it was used."""
    if absmax is not None:
        return absmax
    code = dynamic_code_8bit().to(absmax_q.device)
    return dequantize_blockwise(absmax_q, absmax_scale, code, ABSMAX_BLOCK) + absmax_offset


def dequantize(packed: torch.Tensor, absmax=None, absmax_q=None, absmax_scale=None, absmax_offset=None,
               *, block: int) -> torch.Tensor:
    """-> W (out, in) float32."""
    codes = unpack(packed, 4)                                             # (O, I)
    scales = block_absmax(absmax, absmax_q, absmax_scale, absmax_offset)  # (O*I/block,)
    return dequantize_blockwise(codes.reshape(-1), scales, NF4_CODE, block).view(codes.shape)
