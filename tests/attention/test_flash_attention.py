"""FlashAttention: the torch twin and the Triton kernel against naive attention.

On a machine without CUDA the Triton kernel runs under TRITON_INTERPRET=1 (set below before
the kernel module is imported: triton decides compile vs interpret at decoration time).
With CUDA the same tests run the compiled kernel on the GPU.

Tolerances (the flash-attention project's rule): with ref = naive attention in fp32 on the
same (rounded) inputs and naive_same = naive attention in the input's dtype,
    fp16/bf16: max|out - ref| <= 2 * max|naive_same - ref| + 1e-5  (gradients: 3x)
    fp32:      max|out - ref| <= 1e-5
Interpreter note: tl.dot on bf16 operands is wrong under TRITON_INTERPRET=1 (triton #11584),
so on CPU the kernel upcasts bf16 tiles to fp32 before each dot; the bf16 CPU results below test
that path, and only a CUDA run tests native bf16 dots.
"""
import math
import os

import pytest
import torch

from helpers import LargestNewTensor, count_calls

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import kernels.flash_attention as flash_kernel  # noqa: E402
import minillm.attention.flash as flash_module  # noqa: E402
from kernels.flash_attention import INTERPRETED, triton_flash_attention_forward  # noqa: E402
from minillm.attention.flash import (  # noqa: E402
                                     flash_attention, flash_attention_backward_torch, flash_attention_torch, naive_attention_in_dtype,
                                     naive_attention_in_dtype_lse, online_softmax_steps, triton_usable,
                                     )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def make_qkv(B, Hq, Hkv, Tq, Tk, D, dtype=torch.float32, seed=0, requires_grad=False):
    """Fresh standard-normal inputs (never zeros), different in every batch element and head."""
    gen = torch.Generator().manual_seed(seed)
    qkv = [torch.randn(B, H, T, D, generator=gen) for H, T in ((Hq, Tq), (Hkv, Tk), (Hkv, Tk))]
    return [t.to(DEVICE, dtype).requires_grad_(requires_grad) for t in qkv]


def max_err(a, b):
    return (a.float() - b.float()).abs().max().item()


def assert_matches_naive(o, lse, q, k, v, causal, sm_scale=None):
    """Check o and lse with the tolerance rule from the module docstring."""
    ref_o, ref_lse = naive_attention_in_dtype_lse(q.float(), k.float(), v.float(), causal, sm_scale)
    if q.dtype == torch.float32:
        o_tol = lse_tol = 1e-5
    else:
        same_o, same_lse = naive_attention_in_dtype_lse(q, k, v, causal, sm_scale)
        o_tol = 2 * max_err(same_o, ref_o) + 1e-5
        lse_tol = 2 * max_err(same_lse, ref_lse) + 1e-5
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert max_err(o, ref_o) <= o_tol, (max_err(o, ref_o), o_tol)
    assert max_err(lse, ref_lse) <= lse_tol, (max_err(lse, ref_lse), lse_tol)


# (B, Hq, Hkv, Tq, Tk, D): awkward lengths, GQA ratios 1/3/4, fewer queries than keys
SHAPES = [
    (1, 1, 1, 1, 1, 32),        # one token
    (2, 4, 4, 97, 97, 64),      # batch > 1, MHA, length not a multiple of any tile
    (1, 6, 2, 97, 97, 32),      # GQA 3:1
    (2, 8, 2, 65, 65, 128),     # GQA 4:1, head dim 128
    (1, 9, 3, 1, 97, 64),       # one query after 96 cached keys (decode-like), SmolLM2's 9/3 heads
    (2, 3, 1, 33, 200, 64),     # prefill of 33 tokens after a 167-token cached prefix
    (1, 2, 1, 50, 70, 40),      # head dim 40: padded to 64 and masked
    (1, 1, 1, 19, 23, 59),      # head dim 59
]


# ----------------------------------------------------------------------------- the naive baseline itself

@pytest.mark.parametrize("causal", [True, False])
def test_naive_matches_torch_sdpa(causal):
    """The definition of right agrees with PyTorch's own attention (explicit mask: bottom-right causal)."""
    q, k, v = make_qkv(2, 6, 2, 33, 80, 64)
    mask = None
    if causal:
        mask = torch.ones(33, 80, dtype=torch.bool, device=DEVICE).tril(diagonal=80 - 33)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert max_err(naive_attention_in_dtype(q, k, v, causal), expected) <= 1e-5


# ----------------------------------------------------------------------------- the torch twin

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_torch_tiled_fp32(shape, causal):
    q, k, v = make_qkv(*shape)
    o, lse = flash_attention_torch(q, k, v, causal, block_m=16, block_n=32)
    assert_matches_naive(o, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("blocks", [(16, 16), (7, 13), (128, 128)])
def test_torch_tiled_low_precision_and_tile_sizes(dtype, blocks):
    """Any tile size gives the same answer: tiles that divide nothing, and one tile for everything."""
    q, k, v = make_qkv(2, 6, 2, 61, 90, 64, dtype, seed=1)
    o, lse = flash_attention_torch(q, k, v, True, block_m=blocks[0], block_n=blocks[1])
    assert_matches_naive(o, lse, q, k, v, True)


def test_torch_tiled_never_builds_the_score_matrix():
    """Internals: record every tensor the algorithm creates; none may hold a (Tq, Tk) matrix."""
    B, H, N, D = 1, 2, 256, 32
    q, k, v = make_qkv(B, H, H, N, N, D)
    with LargestNewTensor() as tiled:
        flash_attention_torch(q, k, v, True, block_m=32, block_n=32)
    with LargestNewTensor() as naive:
        naive_attention_in_dtype(q, k, v, True)
    assert naive.largest >= B * H * N * N                  # naive: the full score matrix exists
    assert tiled.largest <= B * H * N * D                  # tiled: nothing bigger than q itself


# ----------------------------------------------------------------------------- the Triton kernel

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
def test_triton_fp32(shape, causal):
    q, k, v = make_qkv(*shape, seed=2)
    o, lse = triton_flash_attention_forward(q, k, v, causal)
    assert_matches_naive(o, lse, q, k, v, causal)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[3], SHAPES[5], SHAPES[6]])
def test_triton_low_precision(dtype, shape):
    q, k, v = make_qkv(*shape, dtype, seed=3)
    o, lse = triton_flash_attention_forward(q, k, v, True)
    assert_matches_naive(o, lse, q, k, v, True)


@pytest.mark.parametrize("causal", [True, False])
def test_triton_long_sequence_1025(causal):
    """1025 = one past a power of two: the last tile holds a single key and a single query."""
    q, k, v = make_qkv(1, 2, 1, 1025, 1025, 32, torch.float16, seed=4)
    o, lse = triton_flash_attention_forward(q, k, v, causal, block_m=64, block_n=64)
    assert_matches_naive(o, lse, q, k, v, causal)


@pytest.mark.parametrize("blocks", [(16, 16), (16, 64), (64, 16)])
def test_triton_tile_sizes_and_scale(blocks):
    q, k, v = make_qkv(2, 4, 2, 45, 77, 32, seed=5)
    o, lse = triton_flash_attention_forward(q, k, v, True, sm_scale=0.3, block_m=blocks[0], block_n=blocks[1])
    assert_matches_naive(o, lse, q, k, v, True, sm_scale=0.3)


def test_triton_reads_strided_inputs():
    """A model holds q as (B, T, H, D) and transposes: the kernel must honour strides, not copy."""
    B, T, Hq, Hkv, D = 2, 40, 6, 2, 32
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(B, T, Hq, D, generator=gen).to(DEVICE).transpose(1, 2)      # (B, Hq, T, D), strided
    kv = torch.randn(B, T, 2, Hkv, D, generator=gen).to(DEVICE)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)              # (B, Hkv, T, D), strided
    assert not q.is_contiguous() and not k.is_contiguous()
    o, lse = triton_flash_attention_forward(q, k, v, True)
    assert_matches_naive(o, lse, q, k, v, True)


# ----------------------------------------------------------------------------- backward and the switch

@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,causal", [((1, 6, 2, 37, 37, 32), True), ((2, 3, 1, 21, 50, 40), True),
                                          ((1, 4, 4, 30, 45, 64), False)])
def test_gradients_match_autograd_through_naive(backend, dtype, shape, causal):
    q, k, v = make_qkv(*shape, dtype, seed=7, requires_grad=True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    grads = torch.autograd.grad(flash_attention(q, k, v, causal, backend=backend), (q, k, v), do)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(naive_attention_in_dtype(q32, k32, v32, causal), (q32, k32, v32), do.float())
    same = torch.autograd.grad(naive_attention_in_dtype(q, k, v, causal), (q, k, v), do)
    for name, g, r, s in zip("qkv", grads, ref, same):
        assert g.shape == r.shape and g.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 3 * max_err(s, r) + 1e-5
        assert max_err(g, r) <= tol, (f"d{name}", max_err(g, r), tol)


def test_backward_torch_direct_matches_autograd():
    """The tiled backward on its own, with a causal offset and tiles that do not divide the lengths."""
    q, k, v = make_qkv(2, 4, 2, 29, 53, 32, seed=9)
    o, lse = flash_attention_torch(q, k, v, True)
    do = torch.randn(q.shape, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    dq, dk, dv = flash_attention_backward_torch(q, k, v, o, lse, do, True, block_m=8, block_n=16)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(naive_attention_in_dtype(qr, kr, vr, True), (qr, kr, vr), do)
    for g, r in zip((dq, dk, dv), ref):
        assert max_err(g, r) <= 1e-5


def test_auto_backend_uses_the_kernel_here():
    assert triton_usable(torch.device(DEVICE))
    assert INTERPRETED == (DEVICE == "cpu")


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("fn", [naive_attention_in_dtype, flash_attention,
                                lambda *a, **kw: flash_attention_torch(*a, **kw),
                                lambda *a, **kw: triton_flash_attention_forward(*a, **kw)])
def test_bad_inputs_raise_clear_errors(fn):
    q, k, v = make_qkv(1, 4, 2, 8, 8, 32)
    with pytest.raises(ValueError, match="q must be a 4-D tensor"):
        fn(q[0], k, v)
    with pytest.raises(ValueError, match="share one dtype"):
        fn(q.half(), k, v)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        fn(q[:, :3], k, v)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        fn(q, k, v[:, :, :4])
    with pytest.raises(ValueError, match="Tq <= Tk"):
        fn(q, k[:, :, :4], v[:, :, :4], causal=True)
    with pytest.raises(ValueError, match="sm_scale"):
        fn(q, k, v, sm_scale=-1.0)
    with pytest.raises(ValueError, match="dtype must be one of"):
        fn(q.double(), k.double(), v.double())


def test_bad_options_raise_clear_errors():
    q, k, v = make_qkv(1, 2, 2, 8, 8, 32)
    with pytest.raises(ValueError, match="backend must be one of"):
        flash_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="block_m must be a positive int"):
        flash_attention_torch(q, k, v, block_m=0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        triton_flash_attention_forward(q, k, v, block_n=48)
    big = torch.randn(1, 1, 4, 288, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    with pytest.raises(ValueError, match="head dim D must be <= 256"):
        triton_flash_attention_forward(big, big, big)


# ----------------------------------------------------------------------------- the real model

def test_smollm2_greedy_tokens_identical_with_flash_attention(llm, monkeypatch):
    """SmolLM2 (9 query heads on 3 KV heads, head dim 64) in fp32: the naive forward with
    attention_backend="flash" routes every attention call through the Triton kernel (counted:
    once per layer, so the PyTorch twin cannot stand in for it); logits stay within 1e-3 and
    greedy tokens do not change. The flash forward is teacher-forced: it is causal, so one pass over
    the prompt and the naive greedy tokens gives at each position what a flash greedy step there would
    see, and its picks must be those tokens (one interpreted pass instead of one per token)."""
    kernel_calls = count_calls(monkeypatch, "triton_flash_attention_forward", flash_kernel, flash_module)
    model, tokenizer = llm.model, llm.get_tokenizer()
    prompt = tokenizer.encode("The three primary colours are")
    tokens = torch.tensor([prompt], device=DEVICE)                           # (1, T)
    with torch.no_grad():
        for _ in range(4):                                                   # naive greedy, whole sequence each step
            logits = model(tokens, attention_backend="naive")[0]             # (T, vocab)
            tokens = torch.cat([tokens, logits[-1].argmax().view(1, 1)], dim=1)
        naive_logits = model(tokens, attention_backend="naive")[0]           # (T + 4, vocab)
        assert not kernel_calls
        flash_logits = model(tokens, attention_backend="flash")[0]           # (T + 4, vocab)
    assert len(kernel_calls) == model.cfg.n_layers
    assert max_err(flash_logits, naive_logits) <= 1e-3
    expected = tokens[0, len(prompt):].tolist()
    assert flash_logits[len(prompt) - 1:-1].argmax(-1).tolist() == expected


def test_llm_prefill_through_flash_attention_keeps_greedy_tokens(smollm2_path, llm, monkeypatch):
    """LLM(attention_backend="flash"): prefill (here in the fast batch-1 path) runs the Triton
    kernel in every layer (counted); the one-token decode steps do not."""
    from minillm import LLM, SamplingParams

    flash_llm = LLM(model=str(smollm2_path), device="cpu", attention_backend="flash")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = ["Explain why the sky is blue, in detail, for a curious child."]
    kernel_calls = count_calls(monkeypatch, "triton_flash_attention_forward", flash_kernel, flash_module)
    got = flash_llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(kernel_calls) == flash_llm.config.n_layers
    assert got == llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("tile", [1, 2, 3, 7])
def test_online_softmax_steps_end_at_softmax_and_logsumexp(tile):
    scores = torch.randn(7, generator=torch.Generator().manual_seed(tile), dtype=torch.float64) * 4
    values = torch.randn(7, generator=torch.Generator().manual_seed(tile + 10), dtype=torch.float64)
    m, l, acc = online_softmax_steps(scores.tolist(), values.tolist(), tile)[-1]
    assert acc / l == pytest.approx(float(torch.softmax(scores, 0) @ values), rel=1e-12)
    assert m + math.log(l) == pytest.approx(float(torch.logsumexp(scores, 0)), rel=1e-12)


def test_online_softmax_steps_reproduce_lesson_05s_worked_example():
    (m1, l1, acc1), (m2, l2, acc2) = online_softmax_steps([2, 1, 3, 0], [10, 20, 30, 40], 2)
    assert (m1, m2) == (2, 3)
    assert (l1, acc1, l2, acc2) == pytest.approx((1.3679, 17.3576, 1.5530, 38.3770), abs=1e-4)
    assert acc2 / l2 == pytest.approx(24.711486, abs=1e-6)
