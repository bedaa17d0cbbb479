"""Rank programs for launch(): small experiments the notebook and the lesson run on N processes.

Each takes (rank, size, ...) like every launch() target and returns plain numbers, so the caller
(one process, no torch.distributed of its own) can print and compare them.
"""
from __future__ import annotations

import torch

from minillm.model.llama import random_model
from . import comm


@torch.no_grad()
def shard_vs_full(rank: int, size: int, cfg, tokens: torch.Tensor, seed: int = 0) -> dict:
    """This rank's shard of a seeded random model against the whole model on the same tokens (B, T):
    the largest logit difference and what the forward sent (calls and bytes per collective)."""
    from .tensor import shard_model

    full = random_model(cfg, seed=seed)
    shard = shard_model(full, rank, size)
    comm.reset_counts()
    logits = shard(tokens)                                                 # (B, T, V) on every rank
    sent = dict(comm.COUNTS)
    return {"max_abs_diff": float((logits - full(tokens)).abs().max()), "counts": sent,
            "kv_heads_here": shard.cfg.n_kv_heads, "ffn_here": shard.cfg.ffn_dim}
