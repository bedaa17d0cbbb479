"""Lab gqa: grouped attention must not materialise Hq/Hkv copies of K or V."""
import torch

from helpers import LargestNewTensor
from minillm.attention.gqa import grouped_attention
from minillm.model.llama import naive_attention_fp32


def test_grouped_attention_copies_no_kv_head():
    B, Hq, Hkv, T, S, D = 1, 8, 2, 3, 50, 16                  # K/V are much larger than q and the scores
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, T, D, generator=g)
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=S - T)[None, None]
    allowed = max(q.numel(), k.numel(), B * Hq * T * S)         # q, one K, or the score matrix
    with LargestNewTensor() as seen:
        out = grouped_attention(q, k, v, mask)
    assert (out - naive_attention_fp32(q, k, v, causal=True)).abs().max() <= 1e-5
    assert seen.largest <= allowed, f"a tensor of {seen.largest} values (repeated K/V?); at most {allowed} allowed"
    with LargestNewTensor() as baseline:                       # the test can fail: the baseline copies
        naive_attention_fp32(q, k, v, causal=True)
    assert baseline.largest >= B * Hq * S * D > allowed
