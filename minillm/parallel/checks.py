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


@torch.no_grad()
def experts_vs_one(rank: int, size: int, cfg, tokens: torch.Tensor, seed: int = 0) -> dict:
    """Expert parallelism: this rank holds 1/size of a seeded random MoE model's routed experts and runs its own
    row of tokens (B = size rows, attention data-parallel); its logits against the whole model's for that row,
    and what its all-to-alls sent."""
    from .expert import ExpertParallelMoE, shard_experts

    full = random_model(cfg, seed=seed)
    want = full(tokens)[rank]                                              # (T, V): the one-process answer
    model = shard_experts(random_model(cfg, seed=seed), rank, size)
    comm.reset_counts()
    logits = model(tokens[rank:rank + 1])[0]                               # (T, V): this rank's own row
    return {"max_abs_diff": float((logits - want).abs().max()), "counts": dict(comm.COUNTS),
            "experts_here": next(l.ffn.w_gate.shape[0] for l in model.layers if isinstance(l.ffn, ExpertParallelMoE))}
