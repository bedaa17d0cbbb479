"""FP8 (e4m3) KV cache: one scale per (token, KV head), like the int8 cache beside it.

    x (..., D)  ->  bits uint8 (..., D) holding float8_e4m3fn values,  scale fp16 (..., 1),
                    x ~= float(bits as e4m3) * scale,   scale = max|x| / 448 (e4m3's largest value)

int8 spaces its 255 levels evenly: every element's error is up to max|x| / 254, so small entries of
a row with one large one lose most of their digits. e4m3 is a float (4 exponent bits, 3 mantissa
bits): the error is relative, at most 2^-4 of the element itself (half a step of 3 mantissa bits),
for elements down to 2^-6 * 448 scale, below which subnormals take over. Same bytes as int8:
D + 2 per token and head.

GPUs since Hopper compute in FP8 natively; vLLM's kv_cache_dtype="fp8" stores e4m3 with ONE scale
per tensor (calibrated, or 1.0). Here each token is quantised once, when it is written, so a
per-token scale needs no calibration. torch has no CPU kernels for index_copy_ on float8, so the
cache holds the bits as uint8 and reinterprets them (Tensor.view(dtype), no copy) to dequantise.
"""
from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max            # 448
FP16_TINY = torch.finfo(torch.float16).tiny


def quantize_kv_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float -> bits uint8 (..., D) (e4m3 values), scale fp16 (..., 1)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=FP16_TINY).half()   # (..., 1)
    q = (xf / scale.float()).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)                             # (..., D) rounds to nearest
    return q.view(torch.uint8), scale


def dequantize_kv_fp8(bits: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bits uint8 (..., D), scale (..., 1) -> (..., D) in dtype."""
    return (bits.view(E4M3).float() * scale.float()).to(dtype)
