"""W8A8 (minillm/quant/w8a8.py): the library's int8 GEMM against the plain integer sum, the layer against
float, and SmoothQuant: an outlier channel ruins plain W8A8, smoothing recovers it, folding changes nothing."""
import pytest
import torch
from torch import nn

from minillm.quant.w8a8 import (W8A8Linear, fold_smoothing, int_matmul, int_matmul_reference, quantize_rows,
                                smoothing_factors)


@pytest.mark.parametrize("rows, inner, out", [(1, 5, 7), (3, 64, 48), (17, 576, 960), (64, 576, 1536)])
def test_the_int8_gemm_is_the_exact_integer_sum(rows, inner, out):
    gen = torch.Generator().manual_seed(rows)
    qx = torch.randint(-127, 128, (rows, inner), generator=gen, dtype=torch.int8)
    qw = torch.randint(-127, 128, (out, inner), generator=gen, dtype=torch.int8)
    got = int_matmul(qx, qw)
    assert got.dtype == torch.int32 and torch.equal(got, int_matmul_reference(qx, qw))


def test_quantize_rows_is_symmetric_per_row_and_within_half_a_step():
    x = torch.randn(6, 40) * torch.arange(1, 7)[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale.shape == (6, 1)
    assert ((q.float() * scale - x).abs() <= scale / 2 + 1e-7).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_layer_is_its_reference_and_close_to_float(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(96, 80, bias=True)
    layer = W8A8Linear(linear)
    x = torch.randn(2, 5, 96).to(dtype)
    fast, ref = layer(x), layer(x, reference=True)
    assert fast.dtype == dtype and fast.shape == (2, 5, 80) and torch.equal(fast, ref)
    want = linear(x.float())
    assert (fast.float() - want).norm() / want.norm() < 0.02
    with pytest.raises(ValueError, match="96 features"):
        layer(torch.randn(3, 95))


def test_an_outlier_channel_ruins_plain_w8a8_and_smoothing_recovers_it():
    """Channel 3 of the input 60x larger than the rest (a massive activation): plain W8A8 spends the token's
    grid on it; smoothed with alpha 0.5, the error falls several-fold; the float product is unchanged."""
    torch.manual_seed(1)
    linear = nn.Linear(128, 64, bias=False)
    x = torch.randn(32, 128)
    x[:, 3] *= 60
    want = linear(x)

    def error(layer, inputs):
        return ((layer(inputs) - want).norm() / want.norm()).item()

    plain = error(W8A8Linear(linear), x)
    s = smoothing_factors(x.abs().amax(dim=0), [linear.weight], alpha=0.5)
    smoothed = nn.Linear(128, 64, bias=False)
    smoothed.weight.data = linear.weight.data * s[None, :]
    torch.testing.assert_close(smoothed(x / s), want, atol=1e-4, rtol=1e-4)
    assert error(W8A8Linear(smoothed), x / s) < plain / 4


def test_folding_into_the_norm_leaves_the_float_model_unchanged():
    torch.manual_seed(2)
    norm, q, k = nn.RMSNorm(48, eps=1e-5), nn.Linear(48, 32, bias=False), nn.Linear(48, 16, bias=False)
    norm.weight.data = torch.rand(48) + 0.5
    h = torch.randn(7, 48)
    want = torch.cat([q(norm(h)), k(norm(h))], dim=-1)
    s = smoothing_factors(norm(h).abs().amax(dim=0), [q.weight, k.weight], alpha=0.6)
    fold_smoothing(norm.weight.data, [q, k], s)
    torch.testing.assert_close(torch.cat([q(norm(h)), k(norm(h))], dim=-1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_outside_zero_to_one_is_refused(alpha):
    with pytest.raises(ValueError, match="alpha"):
        smoothing_factors(torch.ones(4), [torch.ones(2, 4)], alpha=alpha)
