"""Storage formats: int4/int3 packing, RTN, int8, NF4 (against bitsandbytes where it is installed),
QuantLinear, quantize_model / save / load, and the errors bad arguments get."""
import copy

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

from minillm.model.llama import random_model, tiny_config
from minillm.quant import (METHODS, load_quantized, quantize_linear, quantize_model, save_quantized,
                           weight_bytes)
from minillm.quant import cpu_kernels, int4, int8, nf4
from minillm.quant.linear import QuantLinear


# ---- packing ----------------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([3, 4]), rows=st.integers(1, 5), groups_of_8=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_roundtrip_is_bit_exact(bits, rows, groups_of_8, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (rows, 8 * groups_of_8), generator=gen, dtype=torch.uint8)
    packed = int4.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, codes.shape[1] * bits // 8)
    assert torch.equal(int4.unpack(packed, bits), codes)


def test_4bit_layout_first_element_in_high_nibble():
    codes = torch.tensor([[0x1, 0x2, 0xA, 0xF]], dtype=torch.uint8)
    assert int4.pack(codes, 4).tolist() == [[0x12, 0xAF]]


def test_3bit_layout_eight_codes_in_three_bytes_little_end_first():
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.uint8)
    word = sum(c << (3 * i) for i, c in enumerate([1, 2, 3, 4, 5, 6, 7, 0]))
    assert int4.pack(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]


# ---- RTN ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_error_is_at_most_half_a_step(bits, symmetric, group_size):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 576, generator=gen)                        # 576 = 4 x 128 + 64: a short last group
    t = int4.quantize(w, bits, group_size, symmetric)
    deq = int4.dequantize(**t, bits=bits, group_size=group_size)
    step = int4.per_column(t["scale"].float(), group_size, 576)     # (48, 576)
    # half a step; plus, at the extremes, what rounding the scale to fp16 (relative 2^-11) takes
    # off the grid's span of 2^bits - 1 steps
    assert (deq - w).abs().le(step / 2 + 2 ** bits * step * 2 ** -11 + 1e-6).all()
    assert torch.equal(deq, int4.fake_quantize(w, bits, group_size, symmetric))
    assert t["scale"].shape == (48, -(-576 // group_size)) and t["scale"].dtype == torch.float16
    assert ("zero" in t) == (not symmetric)


def test_rtn_asymmetric_keeps_zero_exact_and_beats_symmetric_on_skewed_weights():
    w = torch.rand(16, 128, generator=torch.Generator().manual_seed(1)) * 2 - 0.2        # mostly positive rows
    w[:, 5] = 0.0
    asym = int4.dequantize(**int4.quantize(w, 4, 128, False), bits=4, group_size=128)
    sym = int4.dequantize(**int4.quantize(w, 4, 128, True), bits=4, group_size=128)
    assert (asym[:, 5] == 0).all() and (sym[:, 5] == 0).all()
    assert (asym - w).abs().mean() < 0.75 * (sym - w).abs().mean()


def test_int8_per_channel_error_bound_and_bits():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 576, generator=gen) * torch.logspace(-2, 1, 64)[:, None]   # rows of very different scale
    t = int8.quantize(w)
    assert t["q"].dtype == torch.int8 and t["scale"].shape == (64, 1)
    err = (int8.dequantize(**t) - w).abs()
    assert err.le(w.abs().amax(1, keepdim=True) / 254 * 1.001).all()


# ---- NF4 against bitsandbytes (the `bnb` fixture skips these where it is not installed) ----------

def _bnb_nf4(bnb, A, double_quant):
    packed, state = bnb.quantize_4bit(A, blocksize=64, compress_statistics=double_quant, quant_type="nf4")
    return packed, state


def test_nf4_code_table_is_bitsandbytes(bnb):
    _, state = _bnb_nf4(bnb, torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), False)
    assert torch.equal(state.code, nf4.NF4_CODE)
    assert torch.equal(bnb.create_dynamic_map(), nf4.dynamic_code_8bit())


@pytest.mark.parametrize("shape", [(1024, 1024), (576, 576), (192, 576), (576, 1536)])
def test_nf4_quantize_and_dequantize_bit_identical_to_bitsandbytes(bnb, shape):
    A = torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 0.05
    packed, state = _bnb_nf4(bnb, A, False)
    ours = nf4.quantize(A, 64, double_quant=False)
    assert torch.equal(ours["packed"].reshape(-1), packed.reshape(-1))
    assert torch.equal(ours["absmax"], state.absmax)
    assert torch.equal(nf4.dequantize(**ours, block=64), bnb.dequantize_4bit(packed, state))


@pytest.mark.parametrize("shape", [(1024, 1024), (576, 576), (576, 1536)])
def test_nf4_double_quant_against_bitsandbytes(bnb, shape):
    """Codes, 8-bit block scales and offset: identical to bitsandbytes' PyTorch implementation.
    bitsandbytes' C CPU kernel for the 8-bit absmax codes uses an approximate binary search
    (BinSearch 'Direct2') that sometimes picks a code that is not the nearest: every
    disagreement with it must be one where our code is the nearer one. And our dequantize of
    bitsandbytes' own quant state is bit-identical to its dequantize_4bit."""
    A = torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 0.05
    packed, state = _bnb_nf4(bnb, A, True)
    ours = nf4.quantize(A, 64, double_quant=True)
    assert torch.equal(ours["packed"].reshape(-1), packed.reshape(-1))
    assert torch.equal(ours["absmax_offset"], state.offset.reshape(1))
    assert torch.equal(ours["absmax_scale"], state.state2.absmax)
    # bitsandbytes' reference (pure PyTorch, "default") kernel for 8-bit blockwise quantisation
    plain_absmax = bnb.quantize_4bit(A, blocksize=64, quant_type="nf4")[1].absmax
    default = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
    ref_q, ref_scale = torch.ops.bitsandbytes.quantize_blockwise.default.redispatch(
        default, plain_absmax - state.offset, bnb.create_dynamic_map(), 256)
    assert torch.equal(ours["absmax_q"], ref_q) and torch.equal(ours["absmax_scale"], ref_scale)
    # against the C kernel: rare disagreements, and in each one our code is the nearer
    code = nf4.dynamic_code_8bit()
    differ = (ours["absmax_q"] != state.absmax).nonzero().view(-1)
    assert len(differ) <= 0.01 * len(state.absmax)
    scaled = (plain_absmax - state.offset)[differ] / ref_scale[differ // 256]
    ours_q, c_q = ours["absmax_q"][differ].long(), state.absmax[differ].long()
    assert ((scaled - code[ours_q]).abs() <= (scaled - code[c_q]).abs()).all()
    # dequantisation of bitsandbytes' state, double quantisation included
    theirs = dict(packed=packed.view(shape[0], -1), absmax_q=state.absmax, absmax_scale=state.state2.absmax,
                  absmax_offset=state.offset.reshape(1))
    assert torch.equal(nf4.dequantize(**theirs, block=64), bnb.dequantize_4bit(packed, state))


# ---- NF4 on its own ----------------------------------------------------------------------------

def test_nf4_error_within_bitsandbytes_bounds_and_below_int4_absmax():
    A = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    deq = nf4.dequantize(**nf4.quantize(A, 64), block=64)
    err = (deq - A).abs()
    assert err.mean() < 0.0733                                       # bitsandbytes' test bound (NF4 ~0.0728)
    assert (err / (A.abs() + 1e-8)).mean() < 0.2057
    int4_err = (int4.fake_quantize(A, 4, 64, symmetric=True) - A).abs().mean()   # absmax int4, same block
    assert err.mean() < int4_err


def test_nf4_bits_per_parameter_with_and_without_double_quant():
    w = torch.randn(576, 1536, generator=torch.Generator().manual_seed(3))
    plain = QuantLinear("nf4", 1536, 576, nf4.quantize(w, 64), {"block": 64})
    dq = QuantLinear("nf4", 1536, 576, nf4.quantize(w, 64, double_quant=True), {"block": 64})
    bits = lambda layer: 8 * layer.weight_bytes() / w.numel()  # noqa: E731
    assert bits(plain) == pytest.approx(4 + 32 / 64)
    assert bits(dq) == pytest.approx(4 + 8 / 64 + 32 / (64 * 256), abs=1e-3)   # ~4.127


# ---- QuantLinear, quantize_model, save / load -------------------------------------------------

@pytest.mark.parametrize("method,kw", [("int8", {}), ("int4", {"group_size": 32}), ("int4", {"bits": 3, "symmetric": True}),
                                       ("nf4", {}), ("nf4", {"double_quant": True})])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quant_linear_computes_x_times_dequantised_weight(method, kw, dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(192, 96, bias=True)
    q = quantize_linear(lin, method, **kw)
    x = torch.randn(3, 5, 192, generator=torch.Generator().manual_seed(1)).to(dtype)
    expected = F.linear(x, q.dequantize().to(dtype), lin.bias.to(dtype))
    with cpu_kernels.reference_path(q):     # the definition; the CPU kernels: tests/quant/test_quant_fast.py
        assert q(x).dtype == dtype and torch.equal(q(x), expected)
    rel = (q.dequantize() - lin.weight).norm() / lin.weight.norm()
    assert rel < {"int8": 0.01, "int4": 0.2, "nf4": 0.12}[method]


def format_error_bound(layer: QuantLinear, w: torch.Tensor) -> torch.Tensor:
    """The largest |w - dequantize(q)| each weight (out, in) may have in the layer's format,
    from the format's definition (s: a stored step, already rounded to fp16).
      int8: q = round(w / s), s = max|row| / 127: error <= s / 2. fp16 rounding of s (relative
            2^-11) keeps max|row| / s below 127.5, so the clamp to +-127 never adds to it.
      int (RTN, 3 or 4 bits): error <= s / 2 inside the grid; the fp16 rounding of s (and of the
            zero point) can leave the range's ends outside it by at most 2^bits * s * 2^-11.
      nf4:  per block of 64 weights, the nearest of 16 codes times absmax: error <= absmax times
            half the widest gap between neighbouring codes; with double quantisation the block's
            absmax is itself stored approximately, which adds |absmax - stored absmax| (|code| <= 1).
    Plus the fp32 rounding of the arithmetic itself (relative 1e-6)."""
    stored = layer.quantized_tensors()
    if layer.fmt == "int8":
        bound = stored["scale"].float() / 2 * torch.ones_like(w)
    elif layer.fmt == "int":
        step = int4.per_column(stored["scale"].float(), layer.params["group_size"], layer.in_features)
        bound = step / 2 + 2 ** layer.params["bits"] * step * 2 ** -11
    else:
        absmax = w.reshape(-1, layer.params["block"]).abs().amax(1)                       # (n_blocks,)
        absmax_stored = nf4.block_absmax(**{k: v for k, v in stored.items() if k != "packed"})
        half_gap = nf4.NF4_CODE.diff().max() / 2
        bound = (absmax * half_gap + (absmax - absmax_stored).abs())[:, None].expand(-1, layer.params["block"])
        bound = bound.reshape(w.shape)
    return bound + 1e-6 * w.abs().amax()


@pytest.mark.parametrize("method,kw", [("int8", {}), ("int4", {"group_size": 32}),
                                       ("int4", {"bits": 3, "symmetric": True}), ("nf4", {}),
                                       ("nf4", {"double_quant": True})])
def test_quantize_model_equals_the_dequantised_float_model_and_save_load_roundtrip(tmp_path, method, kw):
    """The quantised model computes exactly what a float model holding the dequantised weights
    computes, and those weights are within the format's error bound of the originals."""
    model = random_model(tiny_config(), seed=0)
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    dequantised = copy.deepcopy(model)                                # the reference: a plain float Llama
    quantize_model(model, method, **kw)
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert len(quantized) == 7 * model.cfg.n_layers
    with torch.no_grad():
        for name, layer in quantized.items():
            original = dequantised.get_submodule(name).weight
            assert ((layer.dequantize() - original).abs() <= format_error_bound(layer, original)).all(), name
            original.copy_(layer.dequantize())
    # Tolerance 0: on the reference path QuantLinear.forward is F.linear(x, dequantize(W)) in x's dtype,
    # the very operation the float reference runs on the same weights, so every logit is bit-identical.
    # (The CPU kernels and the GPU's fused W4A16 kernel sum in another order: tests/quant/test_quant_fast.py
    # and tests/quant/test_quant_w4a16.py bound those.)
    with cpu_kernels.reference_path(model):
        out = model(ids)
        assert torch.equal(out, dequantised(ids))
        path = save_quantized(model, tmp_path / "q.safetensors")
        again = load_quantized(tiny_config(), path)                    # from the config alone
        assert torch.equal(again(ids), out)
        assert torch.equal(load_quantized(None, path)(ids), out)       # config read from the file


def test_weight_bytes_counts_scales():
    model = random_model(tiny_config(), seed=0)
    params = sum(m.weight.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert weight_bytes(model)["bits_per_param"] == 32
    quantize_model(model, "int4", group_size=32, symmetric=False)
    sizes = weight_bytes(model)
    assert sizes["linear_params"] == params
    assert sizes["bits_per_param"] == pytest.approx(4 + 16 / 32 + 8 / 32)   # codes + fp16 scale + uint8 zero


def test_decode_step_bytes_are_the_block_linears_and_the_head():
    from minillm.quant import decode_step_bytes, quantize_lm_head

    model = random_model(tiny_config(), seed=0)
    embed = model.embed.weight
    assert model.lm_head is None                                     # tied: the embedding is the head
    assert decode_step_bytes(model) == weight_bytes(model)["linear_bytes"] + embed.numel() * 4
    quantize_model(model, "int8")
    quantize_lm_head(model)
    assert decode_step_bytes(model) == weight_bytes(model)["linear_bytes"] + model.lm_head.weight_bytes()
    assert decode_step_bytes(model) < embed.numel() * 4 + weight_bytes(model)["linear_bytes"]   # the int8 head is smaller


def test_bad_arguments_raise_clear_errors():
    model = random_model(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="method"):
        quantize_model(model, "int2")
    with pytest.raises(ValueError, match="bits"):
        quantize_model(model, "int4", bits=2)
    with pytest.raises(ValueError, match="group_size"):
        quantize_model(model, "int4", group_size=0)
    with pytest.raises(ValueError, match="calibration_ids"):
        quantize_model(model, "gptq")
    with pytest.raises(ValueError, match="calibration_ids"):
        quantize_model(model, "awq", calibration_ids=torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="block"):
        nf4.quantize(torch.ones(4, 10), 64)
    with pytest.raises(ValueError, match="fmt"):
        QuantLinear("int2", 4, 4, {})
    quantize_model(model, "int8")
    with pytest.raises(ValueError, match="already quantised"):
        quantize_model(model, "int8")
    assert METHODS == ("int8", "int4", "nf4", "gptq", "awq", "w8a8", "fp8")


def test_quantize_model_drops_llm_fused_projections():
    """LLM fuses q/k/v and gate/up (fast_decode.py); quantising must not leave stale fp32 copies."""
    from minillm.stages.fast_decode import fuse_projections, is_fused

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    plain = quantize_model(random_model(tiny_config(), seed=0), "int4", group_size=32)
    fused = fuse_projections(random_model(tiny_config(), seed=0))
    assert is_fused(fused)
    quantize_model(fused, "int4", group_size=32)
    assert not is_fused(fused) and not hasattr(fused.layers[0].attn, "wqkv")
    assert not any(type(m) is torch.nn.Linear for m in fused.layers.modules())
    assert torch.equal(fused(ids), plain(ids))
