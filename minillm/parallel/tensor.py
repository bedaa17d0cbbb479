"""Tensor parallelism: every weight matrix split across N ranks, two all-reduces per layer.

Megatron-LM's split of a Llama block (Shoeybi et al. 2019), rank r of N:

    attention  q, k, v   column-parallel: rows of W (output features) = heads r*H/N .. (r+1)*H/N.
                         Each rank computes its own heads from the full x: no communication, and
                         its KV cache holds only its own KV heads (cfg.n_kv_heads / N of them).
               o_proj    row-parallel: columns of W (input features) = the same heads. Each rank's
                         partial product x_r W_r^T is one term of the sum x W^T: ONE all-reduce.
    SwiGLU     gate, up  column-parallel (silu(gate) * up is elementwise, so it stays local)
               down      row-parallel: ONE all-reduce.
    embedding            vocabulary-parallel: rank r holds rows r*V/N .. (r+1)*V/N; a token outside
                         them contributes zeros; one all-reduce assembles the row.
    LM head              each rank's logits for its vocabulary slice, then an all-gather: the
                         sampler needs the whole distribution (top-p, logprobs); greedy alone could
                         get by with a sharded argmax (2 numbers per rank instead of V/N).

So a forward pass of T tokens communicates 2 x n_layers + 1 all-reduces of (T, dim) plus one
all-gather of the logits. RMSNorm, RoPE and the residual adds are replicated: every rank holds
the full (T, dim) activation after each all-reduce.

shard_model() returns a plain Llama whose cfg has the local head and FFN counts, so every
forward path of the package (model.forward, kv_cache.forward_cached, the paged ModelRunner)
runs on a shard unchanged; what is new lives in RowParallelLinear and the two vocabulary modules.
fast_decode's compiled decode step reads raw weights and would skip the all-reduce: it checks
for plain nn.Linear layers, so a shard (RowParallelLinear) runs the eager fused path instead.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from minillm.model.llama import Llama, ModelConfig
from .comm import all_gather_last, all_reduce


def allowed_tp_sizes(cfg: ModelConfig) -> list[int]:
    """Sizes that split the KV heads (and so the query heads) and the FFN evenly."""
    return [n for n in range(1, cfg.n_kv_heads + 1) if cfg.n_kv_heads % n == 0 and cfg.ffn_dim % n == 0]


def check_tp_size(cfg: ModelConfig, size) -> int:
    allowed = allowed_tp_sizes(cfg)
    if size not in allowed:
        raise ValueError(f"tensor_parallel_size = {size!r} does not split this model's {cfg.n_kv_heads} KV heads "
                         f"({cfg.n_heads} query heads, ffn {cfg.ffn_dim}) evenly; allowed: "
                         f"{', '.join(map(str, allowed))}")
    return size


def row_parallel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, group=None) -> torch.Tensor:
    """x (..., in/N): this rank's slice of the input features; weight (out, in/N): the matching
    columns of W. Returns x_full W^T + bias (..., out), the same on every rank."""
    # BEGIN SOLUTION row_parallel
    partial = F.linear(x, weight)                                  # (..., out): one term of the sum
    out = all_reduce(partial, group)                               # (..., out): the whole sum
    # END SOLUTION
    return out if bias is None else out + bias


class RowParallelLinear(nn.Module):
    """The columns in_start .. in_start + in/N of a Linear; forward sums the ranks' terms."""

    def __init__(self, linear: nn.Linear, rank: int, size: int, group=None):
        super().__init__()
        cols = linear.in_features // size
        self.weight = nn.Parameter(linear.weight.detach()[:, rank * cols:(rank + 1) * cols].clone(), requires_grad=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features, self.group = cols, linear.out_features, group

    def forward(self, x):                                          # (..., in/N) -> (..., out)
        return row_parallel(x, self.weight, self.bias, self.group)


def column_slice(linear: nn.Linear, rank: int, size: int) -> nn.Linear:
    """Rows rank*out/N .. (rank+1)*out/N of a Linear, as a plain nn.Linear (no communication)."""
    rows = linear.out_features // size
    part = nn.Linear(linear.in_features, rows, bias=linear.bias is not None, device="meta")
    part.weight = nn.Parameter(linear.weight.detach()[rank * rows:(rank + 1) * rows].clone(), requires_grad=False)
    if linear.bias is not None:
        part.bias = nn.Parameter(linear.bias.detach()[rank * rows:(rank + 1) * rows].clone(), requires_grad=False)
    return part


def _vocab_slice(weight: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """Rows of a (V, dim) matrix for this rank, the vocabulary padded with zero rows to a multiple
    of N so every rank holds the same count (gloo's all-gather needs equal sizes). -> (V/N, dim), start."""
    per_rank = math.ceil(weight.shape[0] / size)
    start = rank * per_rank
    part = weight.new_zeros(per_rank, weight.shape[1])             # (V/N, dim)
    real = weight[start:start + per_rank]
    part[:real.shape[0]] = real
    return part, start


class VocabParallelEmbedding(nn.Module):
    """Rows start .. start + V/N of the embedding; other tokens look up zeros, the all-reduce fills them in."""

    def __init__(self, embed: nn.Embedding, rank: int, size: int, group=None):
        super().__init__()
        part, self.start = _vocab_slice(embed.weight.detach(), rank, size)
        self.weight = nn.Parameter(part, requires_grad=False)      # (V/N, dim)
        self.group = group

    def forward(self, tokens):                                     # (...) int64 -> (..., dim)
        local = tokens - self.start                                # (...)
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight)   # (..., dim)
        h = h.masked_fill(outside[..., None], 0.0)
        return all_reduce(h, self.group)


class VocabParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary slice, all-gathered into the full (..., V)."""

    def __init__(self, weight: torch.Tensor, vocab_size: int, group=None):
        super().__init__()
        self.weight = weight                                       # (V/N, dim): a Parameter shared with the embedding when tied
        self.vocab_size, self.group = vocab_size, group

    def forward(self, h):                                          # (..., dim) -> (..., V)
        local = F.linear(h, self.weight)                           # (..., V/N)
        return all_gather_last(local, self.group)[..., :self.vocab_size]


def shard_model(model: Llama, rank: int, size: int, group=None) -> Llama:
    """Rank `rank`'s shard of model for tensor_parallel_size `size` (a new module; model is untouched)."""
    cfg = model.cfg
    check_tp_size(cfg, size)
    local = replace(cfg, n_heads=cfg.n_heads // size, n_kv_heads=cfg.n_kv_heads // size, ffn_dim=cfg.ffn_dim // size)
    with torch.device("meta"):
        shard = Llama(local)                                       # skeleton: every weight replaced below
    dtype = model.embed.weight.dtype
    shard.embed = VocabParallelEmbedding(model.embed, rank, size, group)
    head = shard.embed.weight if model.lm_head is None else \
        nn.Parameter(_vocab_slice(model.lm_head.weight.detach(), rank, size)[0], requires_grad=False)
    shard.lm_head = VocabParallelLMHead(head, cfg.vocab_size, group)
    shard.norm = _copy(model.norm)
    for mine, full in zip(shard.layers, model.layers):
        mine.attn_norm, mine.ffn_norm = _copy(full.attn_norm), _copy(full.ffn_norm)
        a, f = full.attn, full.ffn
        if a.q_norm is not None:                                   # per head: every rank's heads use the same
            mine.attn.q_norm, mine.attn.k_norm = _copy(a.q_norm), _copy(a.k_norm)
        mine.attn.wq, mine.attn.wk, mine.attn.wv = (column_slice(m, rank, size) for m in (a.wq, a.wk, a.wv))
        mine.attn.wo = RowParallelLinear(a.wo, rank, size, group)
        mine.ffn.w_gate, mine.ffn.w_up = column_slice(f.w_gate, rank, size), column_slice(f.w_up, rank, size)
        mine.ffn.w_down = RowParallelLinear(f.w_down, rank, size, group)
    shard.tp_rank, shard.tp_size = rank, size
    return shard.to(dtype).eval()


def _copy(norm: nn.Module) -> nn.Module:
    """A replicated module (RMSNorm): every rank holds the whole thing."""
    out = type(norm)(norm.weight.shape[0], norm.eps)
    out.weight = nn.Parameter(norm.weight.detach().clone(), requires_grad=False)
    return out
