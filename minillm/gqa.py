"""Grouped-query attention without copying K/V heads.

The baseline (model.naive_attention) repeats each KV head n_heads // n_kv_heads times before
the matmul: that materialises Hq copies of K and V. Here the G = Hq / Hkv query heads that
share a KV head are folded into the query-length axis instead, so each K/V head is read once:

    q (B, Hq, T, D) -> (B, Hkv, G*T, D);  scores = q @ k^T : (B, Hkv, G*T, S)

G = 1 is multi-head attention (MHA), G = Hq is multi-query attention (MQA).
"""
from __future__ import annotations

import math

import torch


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, Hq, T, D); k, v (B, Hkv, S, D); mask (B or 1, 1, T, S) bool, True = may attend.
    Returns (B, Hq, T, D)."""
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G * T, D)                                  # (B, Hkv, G*T, D): no copy
    scores = (qg @ k.transpose(-1, -2)) * (1.0 / math.sqrt(D))       # (B, Hkv, G*T, S)
    if mask is not None:
        scores = scores.view(B, Hkv, G, T, S).masked_fill(~mask.unsqueeze(2), float("-inf"))
        scores = scores.view(B, Hkv, G * T, S)
    probs = scores.float().softmax(dim=-1).type_as(v)                 # (B, Hkv, G*T, S)
    return (probs @ v).view(B, Hq, T, D)                              # (B, Hq, T, D)
