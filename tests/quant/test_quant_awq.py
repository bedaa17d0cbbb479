"""AWQ: the alpha search never loses to RTN on its objective, folding the scales keeps the
full-precision function, clipping never loses to no clipping, and end to end on a tiny model."""
import copy

import pytest
import torch

from minillm.model.llama import random_model, tiny_config
from minillm.model.positions import rope_cos_sin
from minillm.quant import int4, load_quantized, quantize_model, save_quantized
from minillm.quant.awq import (apply_clip, awq_block, block_inputs, fold_into_linear, fold_into_norm,
                               search_clip, search_scales)


def _salient_model(seed=0):
    """A tiny random model whose norms make a few input channels 8x larger than the rest,
    as trained LLMs have (the situation AWQ is built for)."""
    model = random_model(tiny_config(), seed=seed)
    with torch.no_grad():
        for block in model.layers:
            for norm in (block.attn_norm, block.ffn_norm):
                norm.weight[::16] *= 8
    return model


def _block_setup(model, n=4, T=32, seed=0):
    ids = torch.randint(0, 256, (n, T), generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_cos_sin(torch.arange(T), model.cfg.head_dim, model.cfg.rope_theta)
    return model.embed(ids).detach(), cos, sin


@torch.no_grad()
def test_alpha_search_never_worse_than_rtn_and_alpha0_is_rtn():
    model = _salient_model()
    block = model.layers[0]
    h, cos, sin = _block_setup(model)
    x = block_inputs(block, ["attn.wq"], h, cos, sin)["attn.wq"]
    attn = block.attn
    before = [lin.weight.clone() for lin in (attn.wq, attn.wk, attn.wv)]
    alpha, s, losses = search_scales(x, [attn.wq, attn.wk, attn.wv], lambda t: attn(t, cos, sin), group_size=32)
    assert all(torch.equal(a, lin.weight) for a, lin in zip(before, (attn.wq, attn.wk, attn.wv)))  # restored
    assert len(losses) == 20 and losses[int(round(alpha * 20))] == min(losses) <= losses[0]
    # the alpha = 0 entry is exactly plain RTN of the same weights
    ref = attn(x, cos, sin)
    rtn = copy.deepcopy(attn)
    for lin in (rtn.wq, rtn.wk, rtn.wv):
        lin.weight.copy_(int4.fake_quantize(lin.weight, 4, 32))
    assert losses[0] == pytest.approx((rtn(x, cos, sin) - ref).pow(2).mean().item(), rel=1e-5)
    assert alpha > 0 and min(losses) < 0.9 * losses[0]            # salient channels: scaling pays


@torch.no_grad()
def test_folding_scales_leaves_the_full_precision_block_unchanged():
    model = random_model(tiny_config(), seed=1)
    block = model.layers[0]
    h, cos, sin = _block_setup(model, seed=1)
    ref = block(h, cos, sin)
    gen = torch.Generator().manual_seed(3)
    s = lambda n: torch.rand(n, generator=gen) * 4 + 0.25          # noqa: E731  scales in [0.25, 4.25]
    fold_into_norm(block.attn_norm, [block.attn.wq, block.attn.wk, block.attn.wv], s(96))
    fold_into_norm(block.ffn_norm, [block.ffn.w_gate, block.ffn.w_up], s(96))
    fold_into_linear(block.ffn.w_up, block.ffn.w_down, s(192))
    assert (block(h, cos, sin) - ref).abs().max() <= 1e-4
    assert not torch.equal(block.ffn.w_down.weight, model.layers[1].ffn.w_down.weight)


@torch.no_grad()
def test_clip_search_never_worse_than_no_clip_per_group():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=gen)
    w[:, 5] *= 6                                                   # one outlier column widens every group 0 range
    x = torch.randn(300, 96, generator=gen)
    max_val = search_clip(w, x, group_size=32)                     # (24, 3)
    org_max = int4.grouped(w, 32).abs().amax(-1)
    assert max_val.shape == (24, 3) and (max_val <= org_max).all() and (max_val >= 0.5 * org_max).all()

    def group_err(weight):
        q = int4.fake_quantize(weight, 4, 32)
        diff = int4.grouped(q - w, 32)                              # (24, 3, 32)
        xg = int4.grouped(x, 32)                                    # (300, 3, 32)
        return torch.einsum("ogk,tgk->ogt", diff, xg).pow(2).mean(-1)   # (24, 3)

    lin = torch.nn.Linear(96, 24, bias=False)
    lin.weight.copy_(w)
    apply_clip(lin, max_val, 32)
    assert (group_err(lin.weight) <= group_err(w) * (1 + 1e-5)).all()
    assert (group_err(lin.weight) < group_err(w)).any()


@torch.no_grad()
def test_awq_block_and_model_end_to_end(tmp_path):
    model = _salient_model()
    calib = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(1))
    held_out = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(2))
    ref = model(held_out)
    rtn = quantize_model(_salient_model(), "int4", group_size=32)
    quantize_model(model, "awq", group_size=32, calibration_ids=calib)
    assert len(model.awq_alphas) == 2 and set(model.awq_alphas[0]) == {"qkv", "gate_up", "down"}
    assert (model(held_out) - ref).pow(2).mean() < (rtn(held_out) - ref).pow(2).mean()
    again = load_quantized(tiny_config(), save_quantized(model, tmp_path / "awq.safetensors"))
    assert torch.equal(again(held_out), model(held_out))        # folded norms are saved too


@torch.no_grad()
def test_smollm2_first_blocks_awq(llm):
    """On the real model's first two blocks: the searched scales fold without changing the
    full-precision output, and the block's output error after AWQ is below RTN's."""
    from minillm.quant import calibration_windows

    model = copy.deepcopy(llm.model)
    ids = calibration_windows(llm.get_tokenizer(), n_windows=2, window=256)
    cos, sin = rope_cos_sin(torch.arange(256), model.cfg.head_dim, model.cfg.rope_theta)
    h = model.embed(ids)
    for block in list(model.layers)[:2]:
        ref = block(h, cos, sin)
        rtn = copy.deepcopy(block)
        for lin in [m for m in rtn.modules() if isinstance(m, torch.nn.Linear)]:
            lin.weight.copy_(int4.fake_quantize(lin.weight, 4, 128))
        folded = copy.deepcopy(block)
        awq_block(folded, h, cos, sin, bits=4, group_size=128, symmetric=False)
        # clipping changed the weights, so check the folding alone on a fresh copy
        scaled_only = copy.deepcopy(block)
        x = block_inputs(scaled_only, ["attn.wq"], h, cos, sin)["attn.wq"]
        _, s, _ = search_scales(x, [scaled_only.attn.wq, scaled_only.attn.wk, scaled_only.attn.wv],
                                lambda t: scaled_only.attn(t, cos, sin))
        fold_into_norm(scaled_only.attn_norm, [scaled_only.attn.wq, scaled_only.attn.wk, scaled_only.attn.wv], s)
        assert (scaled_only(h, cos, sin) - ref).abs().max() <= 1e-4 * ref.abs().max()
        for lin in [m for m in folded.modules() if isinstance(m, torch.nn.Linear)]:
            lin.weight.copy_(int4.fake_quantize(lin.weight, 4, 128))
        assert (folded(h, cos, sin) - ref).pow(2).mean() < (rtn(h, cos, sin) - ref).pow(2).mean()
        h = ref
