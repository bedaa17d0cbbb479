"""W8A8 (minillm/quant/w8a8.py, QuantLinear's "w8a8" format): the library's int8 GEMM against the plain integer
sum, the layer against float, SmoothQuant (an outlier channel ruins plain W8A8, smoothing recovers it, folding
changes nothing), a W8A8 model through the engine; and FP8 weights (the "fp8" format, weight-only on a CPU)."""
import pytest
import torch
from torch import nn

from helpers import CharTokenizer, random_prompts
from minillm import LLM, SamplingParams
from minillm.model.llama import random_model, tiny_config
from minillm.quant import cpu_kernels, quantize_linear, quantize_model
from minillm.quant.awq import fold_into_norm
from minillm.quant.w8a8 import StackedW8A8, int_matmul, int_matmul_reference, quantize_rows, smoothing_factors


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
    layer = quantize_linear(linear, "w8a8")
    x = torch.randn(2, 5, 96).to(dtype)
    fast = layer(x)
    with cpu_kernels.reference_path(layer):
        ref = layer(x)
    assert fast.dtype == dtype and fast.shape == (2, 5, 80) and torch.equal(fast, layer.forward_reference(x))
    assert torch.equal(fast, ref)                                       # the integer sum is exact both ways
    want = linear(x.float())
    assert (fast.float() - want).norm() / want.norm() < 0.02


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

    plain = error(quantize_linear(linear, "w8a8"), x)
    s = smoothing_factors(x.abs().amax(dim=0), [linear.weight], alpha=0.5)
    smoothed = nn.Linear(128, 64, bias=False)
    smoothed.weight.data = linear.weight.data * s[None, :]
    torch.testing.assert_close(smoothed(x / s), want, atol=1e-4, rtol=1e-4)
    assert error(quantize_linear(smoothed, "w8a8"), x / s) < plain / 4


def test_folding_into_the_norm_leaves_the_float_model_unchanged():
    torch.manual_seed(2)
    norm, q, k = nn.RMSNorm(48, eps=1e-5), nn.Linear(48, 32, bias=False), nn.Linear(48, 16, bias=False)
    norm.weight.data = torch.rand(48) + 0.5
    h = torch.randn(7, 48)
    want = torch.cat([q(norm(h)), k(norm(h))], dim=-1)
    s = smoothing_factors(norm(h).abs().amax(dim=0), [q.weight, k.weight], alpha=0.6)
    with torch.no_grad():
        fold_into_norm(norm, [q, k], s)
    torch.testing.assert_close(torch.cat([q(norm(h)), k(norm(h))], dim=-1), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("alpha", [-0.1, 1.5])
def test_alpha_outside_zero_to_one_is_refused(alpha):
    with pytest.raises(ValueError, match="alpha"):
        smoothing_factors(torch.ones(4), [torch.ones(2, 4)], alpha=alpha)


def outlier_model(seed=0):
    """A tiny random model whose attention norms blow one channel up 40x: the massive activation that makes
    plain W8A8 lose precision on every other channel of those tokens."""
    model = random_model(tiny_config(), seed=seed)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn_norm.weight[5] *= 40
    return model


def test_smoothquant_through_quantize_model_beats_plain_w8a8_on_an_outlier_model():
    ids = torch.tensor(random_prompts([24, 24, 24, 24], 256, seed=1))         # (4, 24) calibration windows
    x = torch.tensor(random_prompts([20, 20], 256, seed=2))
    float_model = outlier_model()
    with torch.no_grad():
        want = float_model(x)

    def error(model):
        with torch.no_grad():
            return ((model(x) - want).norm() / want.norm()).item()

    plain = error(quantize_model(outlier_model(), "w8a8"))
    smoothed = error(quantize_model(outlier_model(), "w8a8", calibration_ids=ids, alpha=0.5))
    assert smoothed < plain / 2, (plain, smoothed)


def test_stacked_w8a8_is_the_layers_one_by_one():
    """q, k, v (or gate, up) as one StackedW8A8: one quantisation of x, one int8 GEMM, the same numbers."""
    torch.manual_seed(3)
    layers = [quantize_linear(nn.Linear(64, out, bias=False), "w8a8") for out in (64, 16, 16)]
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(StackedW8A8(layers)(x), torch.cat([layer(x) for layer in layers], dim=-1))


def test_a_w8a8_model_serves_through_the_engine_with_its_reference_paths_tokens():
    """The engine runs q/k/v and gate/up as StackedW8A8 and a batch's step compiled (the quantisation and rescale
    generated around the int8 GEMM), with the same greedy tokens as the reference path's layers one by one."""
    cfg = tiny_config()
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 30, 4], cfg.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    model = quantize_model(random_model(cfg, seed=0), "w8a8", lm_head="w8a8")   # (LLM(quantization=) calibrates)
    llm = LLM(model=model, tokenizer=CharTokenizer(), max_model_len=64)
    assert all(m.fmt == "w8a8" for m in llm.model.layers.modules() if hasattr(m, "fmt"))
    assert llm.model.lm_head.fmt == "w8a8"
    runner = llm.engine.runner
    assert all(isinstance(p, StackedW8A8) for w in runner.layer_weights for p in (w[1], w[2], w[4], w[5]))
    assert runner.compile_batched
    fast = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.compiled_batched_steps > 0 and runner.compile_failed is None
    one = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0].token_ids
    assert runner.compiled_decode_steps > 0 and one == fast[0]             # batch 1: the compiled decode step
    with cpu_kernels.reference_path(llm.model):
        reference = LLM(model=llm.model, tokenizer=CharTokenizer(), max_model_len=64)
        assert not reference.engine.runner.compile_batched                 # the QuantLinears one by one, eagerly
        slow = [o.outputs[0].token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    assert fast == slow


def test_a_w8a8_model_saves_and_loads_with_the_same_outputs(tmp_path):
    from minillm.quant import load_quantized, save_quantized

    model = quantize_model(random_model(tiny_config(), seed=4), "w8a8")
    x = torch.tensor(random_prompts([12], 256, seed=3))
    back = load_quantized(None, save_quantized(model, tmp_path / "w8a8.safetensors"))
    assert {m.fmt for m in back.layers.modules() if hasattr(m, "fmt")} == {"w8a8"}
    with torch.no_grad():
        assert torch.equal(back(x), model(x))


def test_fp8_weights_are_e4m3_per_channel_within_half_a_mantissa_step():
    """FP8 weights (weight-only on a CPU): each weight within 2^-4 of itself (3 mantissa bits) above e4m3's
    subnormal range, a row's largest weight mapped to 448; the layer is F.linear with those weights."""
    torch.manual_seed(5)
    linear = nn.Linear(64, 32, bias=False)
    layer = quantize_linear(linear, "fp8")
    w, back = linear.weight.detach(), layer.dequantize()
    normal = w.abs() >= 2 ** -6 * layer.scale.float()                 # e4m3's smallest normal, in weight units
    assert layer.bits.dtype == torch.uint8 and layer.weight_bytes() == 32 * 64 + 32 * 2
    assert ((back - w).abs() <= 2 ** -4 * w.abs() + 1e-12)[normal].all()
    x = torch.randn(3, 64)
    torch.testing.assert_close(layer(x), x @ back.t())


def test_an_fp8_model_serves_through_the_engine_and_saves(tmp_path):
    from minillm.quant import load_quantized, save_quantized

    cfg = tiny_config()
    model = quantize_model(random_model(cfg, seed=6), "fp8")
    llm = LLM(model=model, tokenizer=CharTokenizer(), max_model_len=64)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 12], cfg.vocab_size)]
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
    back = load_quantized(None, save_quantized(model, tmp_path / "fp8.safetensors"))
    x = torch.tensor(random_prompts([9], cfg.vocab_size, seed=7))
    with torch.no_grad():
        assert torch.equal(back(x), model(x))
