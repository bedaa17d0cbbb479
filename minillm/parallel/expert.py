"""Expert parallelism: a mixture of experts split across N ranks by expert, its tokens moved by all-to-all.

DeepSeek-V3's layout (arXiv 2412.19437 §3.4): attention runs data-parallel, each rank with its own requests,
and the routed experts are divided E/N per rank. In every MoE layer each rank

    1. routes its own tokens (the router and the shared experts are on every rank),
    2. dispatch: sends each (token, expert) pair's hidden row to the rank holding that expert (all-to-all),
    3. runs its experts on the rows it received, one GEMM per expert,
    4. combine: sends each output row back to its token's rank (all-to-all, the splits reversed),
    5. weights the rows and adds them to their tokens, with the shared experts' output.

In the engine (LLM(expert_parallel_size=N)) every rank runs the whole batch, attention included, and each MoE
layer splits the rows: a rank sends its 1/N through steps 1-5, then an all-gather gives every rank all the rows.

A pair whose expert lives on another rank crosses the network twice: with even routing, a rank of T tokens
sends 2 T k (N-1)/N rows of `dim` values per MoE layer (calculator.ep_all_to_all_bytes), where tensor
parallelism would all-reduce T x dim twice per layer. Every rank must run the same layers the same number of
times (each all-to-all waits for all ranks), with 0 tokens if it has none.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from minillm.model.llama import Llama
from minillm.model.moe import MoE, expert_mlp
from .comm import all_gather_rows, all_to_all_rows, exchange_counts


def check_ep_size(n_experts: int, size) -> int:
    if not isinstance(size, int) or size < 1 or n_experts % size:
        allowed = [n for n in range(1, n_experts + 1) if n_experts % n == 0]
        raise ValueError(f"expert_parallel_size = {size!r} does not split {n_experts} experts evenly; allowed: "
                         f"{', '.join(map(str, allowed))}")
    return size


def owner(experts: torch.Tensor, n_experts: int, size: int) -> torch.Tensor:
    """The rank that holds each expert: experts 0 .. E/N - 1 on rank 0, the next E/N on rank 1, ..."""
    return experts // (n_experts // size)


class ExpertParallelMoE(MoE):
    """One rank's share of a MoE layer: the router and shared experts whole, routed experts
    rank * E/N .. (rank + 1) * E/N - 1; forward(x) = MoE.forward(x).
    replicated=False: x is this rank's own tokens (attention data-parallel, DeepSeek-V3's layout).
    replicated=True: every rank holds the same x (the engine's workers run the whole batch): each rank takes
    its 1/N of the rows through the all-to-alls, and an all-gather gives every rank the whole output."""

    def __init__(self, moe: MoE, rank: int, size: int, group=None, replicated: bool = False):
        nn.Module.__init__(self)                    # a MoE built from another's weights, not from a config
        s = moe.shape
        per_rank = s.n_experts // check_ep_size(s.n_experts, size)
        self.shape, self.rank, self.size, self.group, self.replicated = s, rank, size, group, replicated
        self.first = rank * per_rank                                    # this rank's first expert
        self.router, self.router_bias, self.shared = moe.router, moe.router_bias, moe.shared
        local = slice(self.first, self.first + per_rank)
        self.w_gate = nn.Parameter(moe.w_gate.data[local].clone(), requires_grad=False)   # (E/N, F, dim)
        self.w_up = nn.Parameter(moe.w_up.data[local].clone(), requires_grad=False)
        self.w_down = nn.Parameter(moe.w_down.data[local].clone(), requires_grad=False)   # (E/N, dim, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:               # (..., dim)
        flat = x.reshape(-1, x.shape[-1])                               # (T, dim)
        if not self.replicated:
            return self.own_tokens(flat).view_as(x)
        rows = [len(r) for r in torch.arange(flat.shape[0]).tensor_split(self.size)]     # each rank's share
        start = sum(rows[:self.rank])
        mine = self.own_tokens(flat[start:start + rows[self.rank]])                       # (T / N, dim)
        return all_gather_rows(mine, rows, self.group).view_as(x)

    def own_tokens(self, flat: torch.Tensor) -> torch.Tensor:
        """flat (T, dim), this rank's tokens -> their MoE outputs (T, dim), through the other ranks' experts."""
        weights, experts = self.routing(flat)                           # 1. (T, k) each
        k, per_rank = experts.shape[1], self.w_gate.shape[0]
        order = experts.flatten().argsort(stable=True)                  # (T k,) pairs by expert, so by rank
        per_expert = torch.bincount(experts.flatten(), minlength=self.shape.n_experts).view(self.size, per_rank)
        arriving = exchange_counts(per_expert, self.group)              # (N, E/N): from each rank, per local expert
        send, recv = per_expert.sum(1).tolist(), arriving.sum(1).tolist()
        rows = all_to_all_rows(flat[order // k], send, recv, self.group)                    # 2. dispatch
        out = self._run_local(rows, arriving)                                               # 3. (R, dim)
        back = all_to_all_rows(out, recv, send, self.group)                                 # 4. combine
        y = back * weights.flatten()[order, None].to(flat.dtype)                            # 5. (T k, dim)
        y = torch.zeros_like(flat).index_add_(0, order // k, y)
        return y if self.shared is None else y + self.shared(flat)

    def _run_local(self, rows: torch.Tensor, arriving: torch.Tensor) -> torch.Tensor:
        """rows (R, dim) received: from each source rank in turn, sorted by expert, arriving[s, e] of them for
        local expert e -> their outputs (R, dim) in the same order."""
        local = torch.cat([torch.repeat_interleave(torch.arange(len(c)), c) for c in arriving])   # (R,)
        order = local.argsort(stable=True)
        out, start = torch.empty_like(rows), 0
        for e, n in enumerate(arriving.sum(0).tolist()):
            if n:
                idx = order[start:start + n]
                out[idx] = expert_mlp(rows[idx], self.w_gate[e], self.w_up[e], self.w_down[e])
            start += n
        return out


def shard_experts(model: Llama, rank: int, size: int, group=None, replicated: bool = False) -> Llama:
    """Every MoE layer of model replaced (in place) by this rank's ExpertParallelMoE; returns model.
    replicated: every rank runs the same tokens (the engine's workers); else each its own."""
    if model.cfg.moe is None:
        raise ValueError("expert parallelism splits a mixture of experts; this model has none (cfg.moe is None)")
    check_ep_size(model.cfg.moe.n_experts, size)
    if dist.is_initialized() and dist.get_world_size(group) != size:
        raise ValueError(f"expert_parallel_size = {size} but the process group has {dist.get_world_size(group)} ranks")
    for layer in model.layers:
        if isinstance(layer.ffn, MoE):
            layer.ffn = ExpertParallelMoE(layer.ffn, rank, size, group, replicated)
    return model
