"""Mixture of experts: the MLP replaced by many small ones, each token sent to a few of them.

    weights, experts = route(x W_router)                  (N, k) each: which k experts, how much of each
    y = sum_j weights[:, j] * expert_{experts[:, j]}(x)  + shared(x)     (shared experts see every token)

A token runs k experts of E, so a step computes like a model of the active parameters while the weights
it may touch are all E (DeepSeek-V3: 8 of 256 routed experts plus 1 shared; 37B of 671B parameters active,
arXiv 2412.19437 §1). Two routers:

    "softmax"   Mixtral / Qwen-MoE: softmax over the E logits, the top k kept (renormalised to sum 1
                where norm_topk is set, as Mixtral does)
    "sigmoid"   DeepSeek-V3 (§2.1.2): an independent sigmoid score per expert; the experts are chosen on
                score + bias (the bias is learned outside the loss, §2.1.2 "auxiliary-loss-free load
                balancing": balance_bias_update), first among the topk_group best of n_group groups
                (a group ranked by the sum of its two best scores), and weighted by the scores without
                the bias, normalised, times routed_scale

Two ways to compute the same sum, equal up to float rounding (tests/model/test_moe.py):

    per_token   each token, each of its k experts, one at a time: the definition
    grouped     the N x k assignments sorted by expert, each expert's tokens gathered and run as one
                GEMM, the outputs weighted and added back to their tokens (what every MoE kernel does,
                and what expert parallelism ships between ranks: parallel/expert.py)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

ROUTERS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEShape:
    """One MoE layout (DeepSeek-V3: 256 experts, top 8, 2048 wide, 1 shared, sigmoid, 8 groups keep 4,
    scale 2.5, the first 3 layers dense; Mixtral-8x7B: 8 experts, top 2, 14336 wide, softmax)."""
    n_experts: int
    top_k: int
    expert_ffn_dim: int
    router: str = "softmax"
    n_shared: int = 0          # shared experts, as one MLP n_shared x expert_ffn_dim wide
    n_group: int = 1
    topk_group: int = 1
    norm_topk: bool = True     # the k weights renormalised to sum to 1
    routed_scale: float = 1.0
    first_dense: int = 0       # layers before this keep the dense MLP (ModelConfig.ffn_dim)

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"router = {self.router!r}; allowed: {', '.join(map(repr, ROUTERS))}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k = {self.top_k}; allowed: 1 .. n_experts ({self.n_experts})")
        if self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group = {self.n_group}, topk_group = {self.topk_group}: n_group must divide "
                             f"n_experts ({self.n_experts}) and 1 <= topk_group <= n_group")
        if self.router == "softmax" and self.n_group != 1:
            raise ValueError("group-limited routing (n_group > 1) is DeepSeek's, with router='sigmoid'")

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_dense

    def num_parameters(self, dim: int, active: bool = False) -> int:
        """One MoE layer's weights: the router, the routed experts (only top_k of them if active), the shared."""
        experts = self.top_k if active else self.n_experts
        return dim * self.n_experts + 3 * dim * self.expert_ffn_dim * (experts + self.n_shared)


def route(logits: torch.Tensor, shape: MoEShape, bias: torch.Tensor | None = None):
    """logits (N, E) -> weights (N, k) fp32 and experts (N, k) int64 for the router of `shape`."""
    logits = logits.float()
    if shape.router == "softmax":
        weights, experts = logits.softmax(dim=-1).topk(shape.top_k, dim=-1)
    else:
        scores = logits.sigmoid()                                          # (N, E), each in (0, 1)
        choice = scores if bias is None else scores + bias                 # the bias steers the choice only
        N, E, G = scores.shape[0], shape.n_experts, shape.n_group
        group_rank = choice.view(N, G, E // G).topk(min(2, E // G), dim=-1).values.sum(-1)     # (N, G)
        kept = group_rank.topk(shape.topk_group, dim=-1).indices                               # (N, topk_group)
        allowed = torch.zeros(N, G, dtype=torch.bool, device=logits.device).scatter_(1, kept, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(E // G, dim=1), float("-inf"))
        experts = choice.topk(shape.top_k, dim=-1).indices                                     # (N, k)
        weights = scores.gather(1, experts)
    if shape.norm_topk:
        weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if shape.router == "sigmoid" else 0.0))
    return weights * shape.routed_scale, experts


def expert_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """One SwiGLU expert: x (n, dim), w_gate w_up (F, dim), w_down (dim, F) -> (n, dim)."""
    return (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ w_down.t()


def per_token(x, weights, experts, w_gate, w_up, w_down) -> torch.Tensor:
    """The definition: x (N, dim), weights experts (N, k); w_gate w_up (E, F, dim), w_down (E, dim, F)."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = int(experts[n, j])
            out[n] += weights[n, j].to(x.dtype) * expert_mlp(x[n:n + 1], w_gate[e], w_up[e], w_down[e])[0]
    return out


def grouped(x, weights, experts, w_gate, w_up, w_down) -> torch.Tensor:
    """The same sum with one GEMM per expert: the N x k (token, expert) pairs sorted by expert, each
    expert's rows gathered, run, weighted, and added back to their tokens."""
    N, k = experts.shape
    order = experts.flatten().argsort(stable=True)                          # (N k,) pairs by expert
    counts = torch.bincount(experts.flatten(), minlength=w_gate.shape[0]).tolist()
    tokens = order // k                                                     # each pair's token
    rows = x[tokens]                                                        # (N k, dim), grouped by expert
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n:
            outs.append(expert_mlp(rows[start:start + n], w_gate[e], w_up[e], w_down[e]))
        start += n
    y = torch.cat(outs) * weights.flatten()[order, None].to(x.dtype)       # (N k, dim)
    return torch.zeros_like(x).index_add_(0, tokens, y)


def expert_load(experts: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Tokens each expert receives (E,) from assignments (N, k)."""
    return torch.bincount(experts.flatten(), minlength=n_experts)


def imbalance(load: torch.Tensor) -> float:
    """max / mean tokens per expert: 1.0 is perfectly even; an expert-parallel step waits for the busiest."""
    return float(load.max()) / float(load.float().mean())


def balance_bias_update(bias: torch.Tensor, load: torch.Tensor, gamma: float) -> torch.Tensor:
    """DeepSeek-V3's auxiliary-loss-free balancing (§2.1.2): after each step the bias of every overloaded
    expert goes down by gamma and of every underloaded one up by gamma (sign of mean load - load)."""
    return bias + gamma * torch.sign(load.float().mean() - load.float())


class MoE(nn.Module):
    """Router, routed experts (stacked (E, F, dim) weights), shared experts; the weights named as the
    loader maps transformers' DeepseekV3MoE and MixtralSparseMoeBlock into them."""

    def __init__(self, cfg):
        super().__init__()
        from .llama import FeedForward

        s: MoEShape = cfg.moe
        self.shape = s
        self.router = nn.Linear(cfg.dim, s.n_experts, bias=False)
        if s.router == "sigmoid":
            self.register_buffer("router_bias", torch.zeros(s.n_experts))
        else:
            self.router_bias = None
        self.w_gate = nn.Parameter(torch.empty(s.n_experts, s.expert_ffn_dim, cfg.dim))
        self.w_up = nn.Parameter(torch.empty(s.n_experts, s.expert_ffn_dim, cfg.dim))
        self.w_down = nn.Parameter(torch.empty(s.n_experts, cfg.dim, s.expert_ffn_dim))
        self.shared = FeedForward(cfg, s.n_shared * s.expert_ffn_dim) if s.n_shared else None

    def routing(self, x: torch.Tensor):
        """x (N, dim) -> weights (N, k), experts (N, k). The router runs in fp32 (as DeepSeek's does)."""
        return route(F.linear(x.float(), self.router.weight.float()), self.shape, self.router_bias)

    def forward(self, x: torch.Tensor, compute=grouped) -> torch.Tensor:   # (..., dim)
        flat = x.reshape(-1, x.shape[-1])                                   # (N, dim)
        weights, experts = self.routing(flat)
        y = compute(flat, weights, experts, self.w_gate, self.w_up, self.w_down)
        if self.shared is not None:
            y = y + self.shared(flat)
        return y.view_as(x)
