"""The Triton FlashAttention backward (kernels/flash_attention_backward.py) against autograd
through naive attention.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before any kernel module
is imported), on tiny shapes: the interpreter is slow. The CUDA-only test at the end runs the
compiled kernels in fp16/bf16.

Tolerances: the rule of tests/attention/test_flash_attention.py for gradients. With ref = autograd through
naive attention in fp32 on the same (rounded) inputs and same = autograd through naive attention
in the input's dtype:
    fp16/bf16: max|grad - ref| <= 3 * max|same - ref| + 1e-5
    fp32:      max|grad - ref| <= 1e-5
Under the interpreter bf16 tiles are upcast to fp32 before each dot (triton #11584), as in the forward.
"""
import os

import pytest
import torch

from helpers import count_calls

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels.flash_attention_backward as bwd_kernel  # noqa: E402
from kernels.flash_attention import triton_flash_attention_forward  # noqa: E402
from kernels.flash_attention_backward import triton_flash_attention_backward  # noqa: E402
from minillm.attention.flash import flash_attention, naive_attention_in_dtype  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_inputs(B, Hq, Hkv, Tq, Tk, D, dtype=torch.float32, seed=0):
    """Standard-normal q, k, v and an upstream gradient do, different in every batch element and head."""
    gen = torch.Generator().manual_seed(seed)
    shapes = ((B, Hq, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, D), (B, Hq, Tq, D))
    return [torch.randn(*s, generator=gen).to(DEVICE, dtype) for s in shapes]


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def naive_grads(q, k, v, do, causal, sm_scale=None):
    """(dq, dk, dv) by autograd through naive attention in q's dtype."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    return torch.autograd.grad(naive_attention_in_dtype(*leaves, causal, sm_scale), leaves, do)


def assert_grads_match_naive(grads, q, k, v, do, causal, sm_scale=None):
    """The tolerance rule of the module docstring; returns the three max errors (for the record)."""
    ref = naive_grads(q.float(), k.float(), v.float(), do.float(), causal, sm_scale)
    same = naive_grads(q, k, v, do, causal, sm_scale) if q.dtype != torch.float32 else ref
    errors = []
    for name, g, r, s, x in zip("qkv", grads, ref, same, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, (f"d{name}", g.shape, g.dtype)
        tol = 1e-5 if q.dtype == torch.float32 else 3 * max_err(s, r) + 1e-5
        assert max_err(g, r) <= tol, (f"d{name}", max_err(g, r), tol)
        errors.append(max_err(g, r))
    return errors


def triton_grads(q, k, v, do, causal, sm_scale=None, **blocks):
    o, lse = triton_flash_attention_forward(q, k, v, causal, sm_scale)
    return triton_flash_attention_backward(q, k, v, o, lse, do, causal, sm_scale, **blocks)


# (B, Hq, Hkv, Tq, Tk, D), tiny: 16 x 16 tiles so every shape spans several tiles and ends mid-tile
SHAPES = [
    (1, 4, 2, 21, 37, 24),      # GQA 2:1, Tq < Tk (causal offset 16), head dim 24 padded to 32
    (2, 2, 2, 19, 19, 16),      # MHA, batch 2, Tq == Tk
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_triton_backward_fp32(shape, causal):
    q, k, v, do = make_inputs(*shape, seed=1)
    assert_grads_match_naive(triton_grads(q, k, v, do, causal, block_m=16, block_n=16), q, k, v, do, causal)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
def test_triton_backward_low_precision(dtype, causal):
    """bf16 (upcast under the interpreter) and fp16 (native dots) on the GQA, padded-head shape."""
    q, k, v, do = make_inputs(*SHAPES[0], dtype, seed=2)
    assert_grads_match_naive(triton_grads(q, k, v, do, causal, block_m=16, block_n=16), q, k, v, do, causal)


def test_triton_backward_scale_one_query_and_strided_inputs():
    """A custom sm_scale, one query row after 30 cached keys, q/do held as (B, T, H, D) transposed."""
    B, Hq, Hkv, Tq, Tk, D = 1, 4, 1, 1, 31, 16
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, Tq, Hq, D, generator=gen).to(DEVICE).transpose(1, 2)       # (B, Hq, Tq, D), strided
    do = torch.randn(B, Tq, Hq, D, generator=gen).to(DEVICE).transpose(1, 2)
    k, v = (torch.randn(B, Hkv, Tk, D, generator=gen).to(DEVICE) for _ in range(2))
    grads = triton_grads(q, k, v, do, True, sm_scale=0.3, block_m=16, block_n=16)
    assert_grads_match_naive(grads, q, k, v, do, True, sm_scale=0.3)


@pytest.mark.parametrize("backend,expected_calls", [("triton", 1), ("torch", 0)])
def test_autograd_function_calls_the_triton_backward_when_asked(monkeypatch, backend, expected_calls):
    """flash_attention(backend="triton").backward() runs the kernel (counted, so the torch twin
    cannot stand in for it) and its gradients match naive; backend="torch" never calls it."""
    calls = count_calls(monkeypatch, "triton_flash_attention_backward", bwd_kernel)
    q, k, v, do = make_inputs(1, 4, 2, 9, 13, 16, seed=4)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(flash_attention(*leaves, True, backend=backend), leaves, do)
    assert len(calls) == expected_calls
    assert_grads_match_naive(grads, q, k, v, do, True)


def test_bad_inputs_raise_clear_errors():
    q, k, v, do = make_inputs(1, 4, 2, 8, 8, 16)
    o, lse = triton_flash_attention_forward(q, k, v, True)
    bwd = triton_flash_attention_backward
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        bwd(q[0], k, v, o, lse, do)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        bwd(q[:, :3], k, v, o[:, :3], lse[:, :3], do[:, :3])
    with pytest.raises(ValueError, match="Tq <= Tk"):
        bwd(q, k[:, :, :4], v[:, :, :4], o, lse, do, causal=True)
    with pytest.raises(ValueError, match="do must have q's shape"):
        bwd(q, k, v, o, lse, do[:, :, :5])
    with pytest.raises(ValueError, match="o.dtype must be q's dtype"):
        bwd(q, k, v, o.half(), lse, do)
    with pytest.raises(ValueError, match="lse must be a float32 tensor"):
        bwd(q, k, v, o, lse.half(), do)
    with pytest.raises(ValueError, match="lse must be a float32 tensor"):
        bwd(q, k, v, o, lse[..., :4], do)
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        bwd(q, k, v, o, lse, do, block_m=24)
    big = torch.randn(1, 1, 2, 288, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    with pytest.raises(ValueError, match="head dim D must be <= 256"):
        bwd(big, big, big, big, torch.zeros(1, 1, 2, device=DEVICE), big)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled kernels")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,causal", [((2, 8, 2, 200, 333, 64), True), ((1, 6, 6, 130, 130, 128), False),
                                          ((1, 9, 3, 77, 77, 40), True)])
def test_triton_backward_cuda(dtype, shape, causal):
    """On the GPU: native fp16/bf16 dots, the default tile sizes, and autograd through flash_attention."""
    q, k, v, do = make_inputs(*shape, dtype, seed=6)
    assert_grads_match_naive(triton_grads(q, k, v, do, causal), q, k, v, do, causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(flash_attention(*leaves, causal), leaves, do)     # "auto": Triton on CUDA
    assert_grads_match_naive(grads, q, k, v, do, causal)


def test_time_triton_backward_runs_on_a_small_shape():
    """The backward comparison the GPU benchmark and notebook 05 run, with naive attention standing in for
    SDPA's flash backend: the Triton gradients agree with it (seconds are meaningless under the interpreter)."""
    from minillm.attention.flash import time_triton_backward

    if torch.cuda.is_available():
        pytest.skip("on CUDA the GPU check runs the real comparison")
    q, k, v, _ = make_inputs(1, 2, 2, 48, 48, 16)
    row = time_triton_backward(q, k, v, True, naive_attention_in_dtype, samples=1)
    assert row["sdpa_flash_backward_ms"] > 0 and row["triton_backward_ms"] > 0
    assert row["backward_max_grad_diff"] < 1e-4 and row["backward_timing"].startswith("perf_counter")


def test_gpu_summary_checks_every_row_against_the_goals():
    from minillm.course.benchmarks.flash_attention import gpu_summary

    rows = [dict(n=1024, fraction_of_sdpa=0.95, speedup_vs_naive=3.0, triton_tflops=100.0),
            dict(n=4096, fraction_of_sdpa=1.2, speedup_vs_naive=9.0, triton_tflops=300.0,
                 backward_fraction_of_sdpa=0.55),
            dict(n=8192, fraction_of_sdpa=0.91, speedup_vs_naive=12.0, triton_tflops=350.0,
                 backward_fraction_of_sdpa=0.8)]
    s = gpu_summary(rows)
    assert s["gpu_min_fraction_of_sdpa_flash"] == 0.91 and s["gpu_min_speedup_vs_naive_n_ge_4096"] == 9.0
    assert s["goals_met"] == {"forward_fraction_of_sdpa": True, "backward_fraction_of_sdpa": False}
    assert s["gpu_min_backward_fraction_of_sdpa_flash"] == 0.55
