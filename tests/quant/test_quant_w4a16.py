"""Fused W4A16 matmul: the PyTorch twin and the Triton kernel against dequantise-then-matmul.

On a machine without CUDA the kernel runs under TRITON_INTERPRET=1 (set before the kernel module
is imported). Tolerance: with ref = x @ dequant(W)^T in fp32 and naive = the same product in x's
dtype, |out - ref| <= 2 * max|naive - ref| + eps(dtype) * max|ref| (fp16/bf16: the last term is the
rounding of the output itself), and 1e-4 relative in fp32.
Under the interpreter bf16 operands are upcast to fp32 before tl.dot (triton #11584): only a
CUDA run tests native bf16 dots.
"""
import os

import pytest
import torch

from helpers import count_calls

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import minillm.quant.w4a16 as twin_module  # noqa: E402
from kernels.w4a16 import w4a16_matmul  # noqa: E402
from kernels.w4a16_gemv import w4a16_gemv  # noqa: E402
from minillm.quant import quantize_linear  # noqa: E402
from minillm.quant.w4a16 import (gemv_operands, gemv_words, operands, supports, w4a16_gemv_torch,  # noqa: E402
                                 w4a16_linear, w4a16_matmul_torch)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (method, kwargs, in_features): int4 sym / asym, a short last group (192 = 128 + 64), NF4 (+ double quant)
LAYERS = [("int4", {"group_size": 64, "symmetric": True}, 128), ("int4", {"group_size": 128}, 192),
          ("int4", {"group_size": 32}, 96), ("nf4", {}, 128), ("nf4", {"double_quant": True}, 192)]


def _layer(method, kw, in_f, out_f=40, seed=0):
    torch.manual_seed(seed)
    return quantize_linear(torch.nn.Linear(in_f, out_f, bias=False), method, **kw)


def _check(out, x, w):
    ref = x.float() @ w.T.float()                                   # (M, N) fp32
    if x.dtype == torch.float32:
        assert (out - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-6
    else:
        naive = (x @ w.to(x.dtype).T).float()
        # plus one unit of the output's own rounding: with few outputs (M = 1) the naive error
        # can be luckily small
        tol = 2 * (naive - ref).abs().max() + torch.finfo(x.dtype).eps * ref.abs().max()
        assert (out.float() - ref).abs().max() <= tol


@pytest.mark.parametrize("method,kw,in_f", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_twin_matches_dequantise_then_matmul(method, kw, in_f, dtype):
    layer = _layer(method, kw, in_f)
    ops = operands(layer)
    x = torch.randn(5, in_f).to(dtype)
    out = w4a16_matmul_torch(x, ops["packed"], ops["scale"], ops["zero"], ops["code"], group=ops["group"])
    assert out.dtype == dtype
    _check(out, x, layer.dequantize())


@pytest.mark.parametrize("method,kw,in_f", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 3, 17])
def test_triton_kernel_matches_dequantise_then_matmul(method, kw, in_f, dtype, M):
    layer = _layer(method, kw, in_f, seed=M).to(DEVICE)
    ops = operands(layer)
    x = torch.randn(M, in_f, device=DEVICE).to(dtype)
    out = w4a16_matmul(x, ops["packed"], ops["scale"], ops["zero"], ops["code"], group=ops["group"])
    assert out.shape == (M, 40) and out.dtype == dtype
    _check(out, x, layer.dequantize())


@pytest.mark.parametrize("method,kw,in_f", LAYERS[:2] + LAYERS[3:4])
def test_triton_kernel_split_k_adds_the_partial_sums(method, kw, in_f):
    """3 splits of 2 tiles (K = 192, 32-column tiles): partial sums in fp32, added by the second kernel."""
    layer = _layer(method, kw, in_f, seed=7).to(DEVICE)
    ops = operands(layer)
    x = torch.randn(17, in_f, device=DEVICE).to(torch.float16)
    out = w4a16_matmul(x, ops["packed"], ops["scale"], ops["zero"], ops["code"], group=ops["group"], split_k=3)
    _check(out, x, layer.dequantize())


def test_gemv_words_put_each_code_where_its_layout_says():
    """Codes 0..15 cycling along a row: decoding nibble i of word j must give the column the layout names."""
    K, tile = 256, 128
    codes = (torch.arange(2 * K) % 16).reshape(2, K).to(torch.uint8)        # (N=2, K)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    for layout in (0, 1):
        words = gemv_words(packed, group=128, layout=layout)                 # (2, K/8)
        assert words.dtype == torch.int32 and words.shape == (2, K // 8)
        for t in range(K // tile):
            for j in range(tile // 8):
                for i in range(8):
                    col = t * tile + (8 * j + (i ^ 1) if layout == 0 else i * (tile // 8) + j)
                    got = (words[:, t * tile // 8 + j] >> (4 * i)) & 0xF
                    assert torch.equal(got, codes[:, col].int()), (layout, t, j, i)
    padded = gemv_words(packed[:, :96], group=128, layout=1)                 # K = 192: a short last tile, padded
    assert padded.shape == (2, 256 // 8)


GEMV_CASES = [(0, 1, 1), (1, 1, 3), (0, 5, 3), (1, 8, 1)]                    # (layout, rows of x, split_k)


@pytest.mark.parametrize("method,kw,in_f", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", [0, 1])
def test_gemv_torch_twin_matches_dequantise_then_matmul(method, kw, in_f, dtype, layout):
    layer = _layer(method, kw, in_f, seed=3)
    ops = operands(layer)
    x = torch.randn(3, in_f).to(dtype)
    words = gemv_words(ops["packed"], ops["group"], layout)
    out = w4a16_gemv_torch(x, words, ops["scale"], ops["zero"], ops["code"], group=ops["group"], layout=layout)
    assert out.dtype == dtype
    _check(out, x, layer.dequantize())


@pytest.mark.parametrize("method,kw,in_f", LAYERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout,M,split_k", GEMV_CASES)
def test_triton_gemv_matches_dequantise_then_matmul(method, kw, in_f, dtype, layout, M, split_k):
    layer = _layer(method, kw, in_f, seed=M + split_k).to(DEVICE)
    g = gemv_operands(layer, layout)                                         # scales in (ng, N) memory
    x = torch.randn(M, in_f, device=DEVICE).to(dtype)
    out = w4a16_gemv(x, g["words"], g["scale"], g["zero"], g["code"], group=g["group"], layout=layout,
                     block_n=16, split_k=split_k)
    assert out.shape == (M, 40) and out.dtype == dtype
    _check(out, x, layer.dequantize())


def test_linear_sends_decode_rows_to_the_gemv_and_more_rows_to_the_matmul(monkeypatch):
    import kernels.w4a16 as mma_module
    import kernels.w4a16_gemv as gemv_module

    gemv_calls = count_calls(monkeypatch, "w4a16_gemv", gemv_module)
    mma_calls = count_calls(monkeypatch, "w4a16_matmul", mma_module)
    layer = _layer("int4", {"group_size": 64}, 128).to(DEVICE)
    expected = {1: (1, 0), 8: (2, 0), 9: (2, 1)}                            # calls of (gemv, matmul) so far
    for rows in (1, 8, 9):
        x = torch.randn(rows, 128, device=DEVICE)
        assert torch.allclose(w4a16_linear(x, layer), x @ layer.dequantize().T, atol=1e-4, rtol=1e-4)
        assert (len(gemv_calls), len(mma_calls)) == expected[rows]


def test_up_to_8_rows_the_tuner_times_the_gemv_against_the_tensor_core_kernel(monkeypatch):
    """Decode-sized calls offer both kernels to choose_config (GEMV first: the untimed default), larger
    calls the tensor-core kernel's configurations only; each candidate's run gives the right product."""
    import minillm.quant.w4a16 as w4

    offered = {}

    def fake_choose(key, configs, run):
        offered[key[1]] = {c["kernel"] for c in configs}
        for c in (configs[0], configs[-1]):                                  # one of each kernel, when offered
            assert torch.allclose(run(c), x2 @ layer.dequantize().T, atol=1e-4, rtol=1e-4)
        return configs[-1]

    monkeypatch.setattr(w4, "choose_config", fake_choose)
    layer = _layer("int4", {"group_size": 64}, 128).to(DEVICE)
    for rows in (1, 8, 9):
        x2 = torch.randn(rows, 128, device=DEVICE)
        w4a16_linear(x2, layer)
        assert layer._w4a16_config["kernel"] == "matmul"                    # the one fake_choose returned
    assert offered == {1: {"gemv", "matmul"}, 8: {"gemv", "matmul"}, 9: {"matmul"}}


def test_gemv_operands_are_cached_and_rebuilt_when_the_weights_change():
    layer = _layer("int4", {"group_size": 64}, 128)
    first = gemv_operands(layer, 1)
    assert gemv_operands(layer, 1) is first
    assert first["scale"].stride() == (1, 40)                                # (N, ng) view of (ng, N) memory
    layer.packed = layer.packed.clone()                                       # new weights: a new address
    assert gemv_operands(layer, 1) is not first


def test_triton_linear_with_bias_batch_dims_and_act_order_perm():
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 24, bias=True)
    layer = quantize_linear(lin, "int4", group_size=64)
    perm = torch.randperm(128)                                       # pretend the codes are in act-order
    layer.register_buffer("perm", perm.to(torch.int32))
    layer.tensor_names += ("perm",)
    layer = layer.to(DEVICE)
    assert supports(layer)
    x = torch.randn(2, 3, 128, device=DEVICE)
    expected = torch.nn.functional.linear(x, layer.dequantize(), layer.bias)   # dequantize undoes perm
    assert torch.allclose(w4a16_linear(x, layer), expected, atol=1e-4, rtol=1e-4)


def test_unsupported_layers_and_bad_inputs():
    assert not supports(_layer("int4", {"bits": 3}, 128))
    assert not supports(_layer("int8", {}, 128))
    assert not supports(_layer("int4", {"group_size": 48}, 96))
    layer = _layer("int4", {"group_size": 64}, 128)
    ops = operands(layer)
    device = "cuda" if torch.cuda.is_available() else "cpu"      # the kernel's device check comes first
    with pytest.raises(ValueError, match="K = 2"):
        w4a16_matmul(torch.randn(2, 64, device=device), ops["packed"].to(device), ops["scale"].to(device), group=64)
    x, packed, scale = torch.randn(2, 128, device=device), ops["packed"].to(device), ops["scale"].to(device)
    with pytest.raises(ValueError, match="split_k"):
        w4a16_matmul(x, packed, scale, group=64, split_k=0)
    with pytest.raises(ValueError, match="block_n"):
        w4a16_matmul(x, packed, scale, group=64, block_n=24)
    words = gemv_words(packed, 64, 0)
    with pytest.raises(ValueError, match="1..8 rows"):
        w4a16_gemv(torch.randn(9, 128, device=device), words, scale, group=64)
    with pytest.raises(ValueError, match="int32"):
        w4a16_gemv(x, packed, scale, group=64)
    with pytest.raises(ValueError, match="words per row"):
        w4a16_gemv(torch.randn(2, 256, device=device), words, scale, group=64)
    with pytest.raises(ValueError, match="layout"):
        w4a16_gemv(x, words, scale, group=64, layout=2)
    with pytest.raises(ValueError, match="block_n"):
        w4a16_gemv(x, words, scale, group=64, block_n=12)
    with pytest.raises(ValueError, match="scale must be"):
        w4a16_gemv(x, words, scale[:, :1], group=64)
    asym = operands(_layer("int4", {"group_size": 64}, 128))                 # zero (N, ng) row-major
    with pytest.raises(ValueError, match="zero must have scale's shape and strides"):
        w4a16_gemv(x, gemv_words(asym["packed"].to(device), 64, 1), asym["scale"].t().contiguous().t().to(device),
                   asym["zero"].to(device), group=64, layout=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="QuantLinear uses the fused kernel only on CUDA")
def test_quant_linear_uses_the_kernel_on_cuda(monkeypatch):
    """The kernel launch is counted: dequantise-then-matmul would give the same numbers."""
    import kernels.w4a16 as kernel_module
    import minillm.quant.linear as linear_module
    import kernels.w4a16_gemv as gemv_module

    kernel_calls = count_calls(monkeypatch, "w4a16_matmul", kernel_module, twin_module, linear_module)
    gemv_calls = count_calls(monkeypatch, "w4a16_gemv", gemv_module)
    layer = _layer("int4", {"group_size": 128}, 256).cuda()
    for rows in (16, 1):
        x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(1)).to("cuda", torch.float16)
        ref = x @ layer.dequantize().half().T
        assert torch.allclose(layer(x), ref, atol=2e-2, rtol=1e-2)
    assert len(kernel_calls) >= 1 and len(gemv_calls) >= 1           # tuning calls each more than once


def test_kernel_benchmark_runs_every_path_on_a_small_shape():
    """The GPU benchmark's code, run under the interpreter on CPU (seconds are meaningless there)."""
    from minillm.course.benchmarks.quant import kernel_benchmark

    if torch.cuda.is_available():
        pytest.skip("the CUDA run of this benchmark is the GPU check's")
    out = kernel_benchmark(device="cpu", shapes=((32, 256),), batches=(1, 2, 9), samples=2)
    batch_1, batch_2, batch_9 = out["results"]
    assert [r["w4a16_kernel"] for r in out["results"]] == ["gemv", "gemv", "matmul"]
    assert batch_1["gemv_layout_0_us"] > 0 and batch_1["gemv_layout_1_us"] > 0 and "gemv_layout_0_us" not in batch_2
    assert batch_9["first_run_kernel_us"] > 0
    assert all(r["correct"] for r in out["results"]) and batch_1["max_abs_err_vs_dequantised_fp32"] < 1e-2
    assert out["gpu"] is None and out["copy_GB_s"] > 0 and out["results"][0]["timing"].startswith("perf_counter")
