"""Grouped attention (no K/V copies) equals the repeat_interleave baseline for MHA, GQA, MQA."""
import pytest
import torch

from minillm.attention.gqa import grouped_attention
from minillm.model.llama import naive_attention_fp32


@pytest.mark.parametrize("n_heads, n_kv_heads", [(9, 9), (9, 3), (9, 1)])   # MHA, SmolLM2's GQA, MQA
@pytest.mark.parametrize("T, S", [(1, 1), (7, 7), (1, 30), (5, 23)])
def test_grouped_equals_repeat_interleave(n_heads, n_kv_heads, T, S):
    g = torch.Generator().manual_seed(T * 100 + S)
    q = torch.randn(2, n_heads, T, 64, generator=g)
    k = torch.randn(2, n_kv_heads, S, 64, generator=g)
    v = torch.randn(2, n_kv_heads, S, 64, generator=g)
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)[None, None]   # (1, 1, T, S)
    assert (grouped_attention(q, k, v, mask) - naive_attention_fp32(q, k, v, causal=True)).abs().max() <= 1e-5
