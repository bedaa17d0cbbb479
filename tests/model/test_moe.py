"""Mixture of experts (model/moe.py): grouped expert computation equals the per-token definition, both
routers choose what their definitions say, and DeepSeek-V3's bias update evens the load."""
from __future__ import annotations

import pytest
import torch

from minillm.model.llama import random_model, tiny_config
from minillm.model.moe import (MoEShape, balance_bias_update, expert_load, grouped, imbalance, per_token,
                               route)

SIGMOID = MoEShape(n_experts=16, top_k=4, expert_ffn_dim=24, router="sigmoid", n_shared=1, n_group=4,
                   topk_group=2, routed_scale=2.5, first_dense=1)
SOFTMAX = MoEShape(n_experts=8, top_k=2, expert_ffn_dim=24)


@pytest.mark.parametrize("shape", [SIGMOID, SOFTMAX], ids=["sigmoid", "softmax"])
@torch.no_grad()
def test_grouped_experts_equal_the_per_token_sum(shape):
    model = random_model(tiny_config(moe=shape), seed=3)
    moe = model.layers[1].ffn
    x = torch.randn(50, 96, generator=torch.Generator().manual_seed(2))
    weights, experts = moe.routing(x)
    ref = per_token(x, weights, experts, moe.w_gate, moe.w_up, moe.w_down)
    out = grouped(x, weights, experts, moe.w_gate, moe.w_up, moe.w_down)
    assert (ref - out).abs().max().item() < 1e-5 * ref.abs().max().item()
    assert torch.allclose(moe(x), out + (moe.shared(x) if moe.shared else 0), atol=1e-6)


def test_the_sigmoid_router_keeps_to_its_best_groups_and_uses_the_bias_only_to_choose():
    logits = torch.randn(200, 16, generator=torch.Generator().manual_seed(0))
    bias = torch.zeros(16)
    bias[:4] = 10.0                                           # group 0's experts always look best
    weights, experts = route(logits, SIGMOID, bias)
    groups = experts // 4                                     # 4 groups of 4 experts
    assert ((groups == 0).any(1)).all()                       # every token chose in group 0
    assert all(len(set(row.tolist())) <= 2 for row in groups)   # and in at most topk_group = 2 groups
    scores = logits.sigmoid().gather(1, experts)              # weights are the unbiased scores, normalised
    assert torch.allclose(weights, 2.5 * scores / scores.sum(-1, keepdim=True))


def test_the_softmax_router_is_mixtrals_top_k_renormalised():
    logits = torch.randn(30, 8, generator=torch.Generator().manual_seed(1))
    weights, experts = route(logits, SOFTMAX)
    top = logits.topk(2, dim=-1)
    assert torch.equal(experts, top.indices)
    assert torch.allclose(weights, top.values.softmax(-1))


def test_bias_updates_even_out_a_skewed_load():
    """DeepSeek-V3's auxiliary-loss-free balancing on a router whose logits favour a few experts."""
    gen = torch.Generator().manual_seed(5)
    skew = torch.linspace(-1.5, 1.5, 16)
    shape = MoEShape(n_experts=16, top_k=4, expert_ffn_dim=8, router="sigmoid")
    bias = torch.zeros(16)
    first = None
    for _ in range(60):
        logits = torch.randn(256, 16, generator=gen) + skew
        load = expert_load(route(logits, shape, bias)[1], 16)
        first = imbalance(load) if first is None else first
        bias = balance_bias_update(bias, load, gamma=0.02)
    assert first > 2.0 and imbalance(load) < 1.4


def test_active_parameters_count_only_the_chosen_experts():
    cfg = tiny_config(moe=SIGMOID)
    model = random_model(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    moe_layers = cfg.n_layers - SIGMOID.first_dense
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == moe_layers * 3 * 96 * 24 * (16 - 4)


@pytest.mark.parametrize("bad, named", [(dict(router="relu"), "router = 'relu'"), (dict(top_k=9), "top_k = 9"),
                                        (dict(router="sigmoid", n_group=3), "n_group = 3"),
                                        (dict(n_group=2), "group-limited routing")])
def test_a_bad_moe_shape_is_refused_by_name(bad, named):
    with pytest.raises(ValueError, match=named):
        MoEShape(**{**dict(n_experts=8, top_k=2, expert_ffn_dim=8), **bad})
