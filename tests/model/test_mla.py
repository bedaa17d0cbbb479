"""Multi-head latent attention (model/mla.py): the absorbed form equals the naive one, the cache holds
only the latent and the RoPE key, and the parameter count is the model's."""
from __future__ import annotations

import pytest
import torch

from minillm.model.llama import naive_attention_fp32, random_model, sdpa_attention, tiny_config
from minillm.model.mla import MLAShape, absorbed_query, split_kv_up
from minillm.model.positions import rope_cos_sin

SHAPE = MLAShape(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def mla_model(q_lora_rank=24, seed=0):
    shape = MLAShape(q_lora_rank, 32, 16, 8, 12)
    return random_model(tiny_config(n_kv_heads=6, head_dim=8, mla=shape), seed=seed)


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("attend", [naive_attention_fp32, sdpa_attention])
@torch.no_grad()
def test_absorbed_attention_equals_the_naive_expansion(q_lora_rank, attend):
    """Scores from the cached latent (q moved into the latent space by W_uk) and outputs mapped by W_uv
    afterwards: the same as expanding every head's K and V, for a prefill of 40 and a decode row."""
    attn = mla_model(q_lora_rank).layers[0].attn
    x = torch.randn(2, 40, 96, generator=torch.Generator().manual_seed(1))
    cos, sin = rope_cos_sin(torch.arange(40), 8, 10000.0)
    naive = attn(x, cos, sin, attend)
    absorbed = attn(x, cos, sin, attend, absorbed=True)
    assert naive.shape == absorbed.shape == (2, 40, 96)
    assert (naive - absorbed).abs().max().item() < 1e-5 * naive.abs().max().item() * 10


@torch.no_grad()
def test_absorbed_query_dot_latent_is_the_naive_score():
    """The identity the decode relies on, one head at a time: q_nope . (W_uk c) = (W_uk^T q_nope) . c."""
    w = torch.randn(6 * (16 + 12), 32, dtype=torch.float64)
    w_uk, w_uv = split_kv_up(w, SHAPE, 6)
    assert w_uk.shape == (6, 16, 32) and w_uv.shape == (6, 12, 32)
    q = torch.randn(6, 24, dtype=torch.float64)                 # (H, d_nope + d_rope)
    c, k_rope = torch.randn(32, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    naive = torch.stack([q[h, :16] @ (w_uk[h] @ c) + q[h, 16:] @ k_rope for h in range(6)])
    absorbed = absorbed_query(q, w_uk, SHAPE) @ torch.cat([c, k_rope])
    assert torch.allclose(naive, absorbed, rtol=1e-12)


def test_the_latent_cache_is_576_values_for_deepseek_v3_and_the_parameters_add_up():
    v3 = MLAShape(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    assert v3.cache_width == 576 and v3.qk_head_dim == 192
    model = mla_model()
    assert model.cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    c, k_rope = model.layers[0].attn.latents(torch.randn(1, 5, 96), *rope_cos_sin(torch.arange(5), 8, 1e4))
    assert c.shape == (1, 5, 32) and k_rope.shape == (1, 5, 8)


def test_an_mla_shape_that_contradicts_the_model_is_refused():
    with pytest.raises(ValueError, match="n_kv_heads = n_heads"):
        tiny_config(n_kv_heads=2, head_dim=8, mla=SHAPE)
    with pytest.raises(ValueError, match="head_dim = mla.qk_rope_head_dim"):
        tiny_config(n_kv_heads=6, head_dim=16, mla=SHAPE)
    with pytest.raises(ValueError, match="'flash' needs values as wide as keys"):
        mla_model()(torch.tensor([[1, 2, 3]]), attention_backend="flash")
