"""int8 KV cache: one scale per (token, KV head), symmetric absmax over the head dimension.

    x (B, Hkv, T, D)  ->  q int8 (B, Hkv, T, D),  scale fp16 (B, Hkv, T, 1),   x ~= q * scale

Per-token scales let a cache quantise each new token once, when it is written, without ever
revisiting older entries. Cost: D bytes + 2 bytes of scale per token and head, against 2*D bytes
in fp16: (64 + 2) / 128 = 0.52 of fp16 for SmolLM2's head_dim 64.

Why the attention output barely moves: every element's error is at most scale/2 = max|x|/254.
An error in V enters the output through a convex combination (softmax weights sum to 1), so
|d out| <= max|dV|. An error in K shifts each score by at most eps = |q|_1 * max|dK| / sqrt(D),
which scales every softmax weight by a factor in [e^-2eps, e^2eps]. attention_error_bound()
turns this into a bound the tests check.
"""
from __future__ import annotations

import math

import torch

FP16_TINY = torch.finfo(torch.float16).tiny


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, Hkv, T, D) float -> q int8 (B, Hkv, T, D), scale fp16 (B, Hkv, T, 1).
    (Any 4-d layout with head_dim last works: the paged cache passes (1, N, Hkv, D).)"""
    if x.dim() != 4:
        raise ValueError(f"x must be 4-d with head_dim last, e.g. (B, Hkv, T, D); got {tuple(x.shape)}")
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / 127).clamp(min=FP16_TINY).half()  # (B, Hkv, T, 1)
    q = torch.clamp(torch.round(xf / scale.float()), -127, 127).to(torch.int8)          # (B, Hkv, T, D)
    return q, scale


def dequantize_kv(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q int8 (..., D), scale (..., 1) -> (..., D) in dtype."""
    return (q.float() * scale.float()).to(dtype)


def kv_bytes(q: torch.Tensor, scale: torch.Tensor) -> int:
    return q.numel() * q.element_size() + scale.numel() * scale.element_size()


def attention_error_bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          k_hat: torch.Tensor, v_hat: torch.Tensor) -> torch.Tensor:
    """Worst-case |attn(q, k_hat, v_hat) - attn(q, k, v)| per query row (B, Hq, T), from the
    element errors of k_hat and v_hat (see the module docstring). q (B, Hq, T, D), k/v (B, Hkv, S, D)."""
    n_rep = q.shape[1] // k.shape[1]
    dk = (k_hat.float() - k.float()).abs().amax(dim=(-2, -1))                 # (B, Hkv)
    dv = (v_hat.float() - v.float()).abs().amax(dim=(-2, -1))                 # (B, Hkv)
    vmax = v_hat.float().abs().amax(dim=(-2, -1))                              # (B, Hkv)
    dk, dv, vmax = (t.repeat_interleave(n_rep, dim=1)[..., None] for t in (dk, dv, vmax))  # (B, Hq, 1)
    eps = q.float().abs().sum(-1) * dk / math.sqrt(q.shape[-1])               # (B, Hq, T): max score shift
    return dv + torch.expm1(2 * eps) * vmax
