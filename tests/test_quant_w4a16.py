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

from kernels.w4a16 import w4a16_matmul  # noqa: E402
from minillm.quant import quantize_linear  # noqa: E402
from minillm.quant.w4a16 import operands, supports, w4a16_linear, w4a16_matmul_torch  # noqa: E402

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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="QuantLinear uses the fused kernel only on CUDA")
def test_quant_linear_uses_the_kernel_on_cuda(monkeypatch):
    """The kernel launch is counted: dequantise-then-matmul would give the same numbers."""
    import kernels.w4a16 as kernel_module
    import minillm.quant.linear as linear_module
    import minillm.quant.w4a16 as twin_module

    kernel_calls = count_calls(monkeypatch, "w4a16_matmul", kernel_module, twin_module, linear_module)
    layer = _layer("int4", {"group_size": 128}, 256).cuda()
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(1)).to("cuda", torch.float16)
    ref = x @ layer.dequantize().half().T
    assert torch.allclose(layer(x), ref, atol=2e-2, rtol=1e-2)
    assert len(kernel_calls) == 1
