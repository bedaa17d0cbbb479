"""Grouped-query attention without copying K/V heads.

The baseline (model.llama.naive_attention_fp32) repeats each KV head n_heads // n_kv_heads times
before the matmul: that materialises Hq copies of K and V. Here the G = Hq / Hkv query heads that
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
    # BEGIN SOLUTION gqa
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
    # END SOLUTION


# ---- MHA -> GQA / MQA conversion (Ainslie et al. 2023, "GQA: Training Generalized Multi-Query
# Transformer Models from Multi-Head Checkpoints") ------------------------------------------------

def mean_pool_kv_heads(weight: torch.Tensor, n_kv_heads: int, new_kv_heads: int) -> torch.Tensor:
    """K or V projection rows (n_kv_heads * D, ...) -> (new_kv_heads * D, ...): each new head is
    the mean of the old heads in its group. Works for weights (rows, dim) and biases (rows,)."""
    if n_kv_heads % new_kv_heads:
        raise ValueError(f"new_kv_heads ({new_kv_heads}) must divide n_kv_heads ({n_kv_heads})")
    # BEGIN SOLUTION gqa
    D = weight.shape[0] // n_kv_heads
    grouped = weight.reshape(new_kv_heads, n_kv_heads // new_kv_heads, D, *weight.shape[1:])
    return grouped.mean(dim=1).reshape(new_kv_heads * D, *weight.shape[1:])
    # END SOLUTION


@torch.no_grad()
def convert_kv_heads(model, new_kv_heads: int):
    """Return a copy of `model` whose attention has `new_kv_heads` K/V heads (1 = MQA).
    Without uptraining the model loses quality: the lesson measures how much."""
    import copy
    from dataclasses import replace

    import torch.nn as nn

    cfg = model.cfg
    if new_kv_heads < 1 or cfg.n_heads % new_kv_heads:
        raise ValueError(f"new_kv_heads must divide n_heads ({cfg.n_heads}); got {new_kv_heads}")
    new = copy.deepcopy(model)
    new.cfg = replace(cfg, n_kv_heads=new_kv_heads)
    for layer in new.layers:
        attn = layer.attn
        for name in ("wk", "wv"):
            old = getattr(attn, name)
            lin = nn.Linear(cfg.dim, new_kv_heads * cfg.head_dim, bias=old.bias is not None,
                            dtype=old.weight.dtype, device=old.weight.device)
            lin.weight.copy_(mean_pool_kv_heads(old.weight, cfg.n_kv_heads, new_kv_heads))
            if old.bias is not None:
                lin.bias.copy_(mean_pool_kv_heads(old.bias, cfg.n_kv_heads, new_kv_heads))
            setattr(attn, name, lin)
        attn.n_kv_heads = new_kv_heads
        for fused in ("wqkv",):                  # a fused projection would still hold the old heads
            if hasattr(attn, fused):
                delattr(attn, fused)
    return new
