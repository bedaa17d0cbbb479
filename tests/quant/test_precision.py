"""fp16 vs bf16: activation ranges are recorded per layer, and overflow is caught where it happens."""
import torch

from minillm.model.llama import random_model, tiny_config
from minillm.quant.precision import FP16, activation_ranges, compare_dtypes, overflow_scale, perplexity_of


def test_ranges_are_the_largest_activation_of_each_layer():
    model = random_model(tiny_config())
    tokens = torch.randint(3, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    ranges = activation_ranges(model, tokens)
    assert [r.layer for r in ranges] == list(range(model.cfg.n_layers))
    h = model.embed(tokens)
    from minillm.model.positions import rope_cos_sin
    cos, sin = rope_cos_sin(torch.arange(32), model.cfg.head_dim, model.cfg.rope_theta)
    with torch.no_grad():
        for layer, r in zip(model.layers, ranges):
            h = layer(h, cos, sin)
            assert r.residual_max == h.abs().max().item()
    assert overflow_scale(ranges) == FP16.max / max(max(r.residual_max, r.ffn_hidden_max) for r in ranges)


def test_fp16_overflows_where_bf16_does_not():
    model = random_model(tiny_config())
    tokens = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(1))
    calm = {r.dtype: r for r in compare_dtypes(model, tokens)}
    assert calm["float32"].logit_max_abs_err == 0 and calm["float32"].argmax_agreement == 1
    assert calm["float16"].nonfinite_activations == 0 and calm["bfloat16"].nonfinite_activations == 0
    assert calm["float16"].logit_rel_err < calm["bfloat16"].logit_rel_err    # 10 mantissa bits vs 7
    with torch.no_grad():
        model.embed.weight.mul_(1e6)            # a residual stream far beyond fp16's 65504
    assert overflow_scale(activation_ranges(model, tokens)) < 1
    hot = {r.dtype: r for r in compare_dtypes(model, tokens)}
    assert hot["float16"].nonfinite_activations > 0
    assert hot["bfloat16"].nonfinite_activations == 0


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    tokens = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(2))
    assert abs(perplexity_of(torch.zeros(2, 9, 50), tokens) - 50) < 1e-3
