"""Prepacked CPU weights (minillm/model/prepacked.py): the engine's GEMMs through MKL's / oneDNN's blocked
layout give F.linear's results, the faster library is the one chosen, and the engine really runs them."""
import pytest
import torch
import torch.nn.functional as F

from helpers import CharTokenizer, random_prompts
from minillm import LLM, SamplingParams
from minillm.model import prepacked
from minillm.model.llama import random_model, tiny_config

needs_mkl = pytest.mark.skipif(not torch._C.has_mkl, reason="fp32 prepacking is MKL's (an x86 build of torch)")
needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is not built into torch")
needs_onednn_bf16 = pytest.mark.skipif(not prepacked.onednn_supports(torch.bfloat16),
                                       reason="oneDNN's bf16 GEMM needs AVX-512 or AVX-NE-CONVERT, which this CPU lacks")


@needs_mkl
@pytest.mark.parametrize("rows", [1, 4, 16, 33])
def test_fp32_mkl_prepacked_gemm_is_bit_equal_to_f_linear(rows):
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(rows, 64)                     # (out, in), (N, in)
    packed = prepacked.PrepackedLinear(w, rows=16, library="mkl")
    assert packed.library == "mkl"
    assert torch.equal(packed(x), F.linear(x, w))


@needs_onednn
@pytest.mark.parametrize("rows", [1, 4, 16, 33])
def test_fp32_onednn_prepacked_gemm_matches_f_linear_to_fp32_rounding(rows):
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(rows, 64)
    packed = prepacked.PrepackedLinear(w, rows=16, library="onednn")
    assert packed.library == "onednn"
    exact = x.double() @ w.double().t()                                   # (N, out)
    assert (packed(x).double() - exact).abs().max() <= 1e-5 * exact.abs().max()   # fp32, not a 2-byte shortcut


@needs_mkl
@needs_onednn
def test_the_tuning_step_keeps_the_library_timed_faster_per_shape_and_is_skippable(monkeypatch):
    seconds = {"mkl": 2.0, "onednn": 1.0}
    timed = []
    monkeypatch.setattr(prepacked, "seconds_of_one_call",
                        lambda packed, x: timed.append(packed.library) or seconds[packed.library])
    a, b, c = torch.randn(96, 64), torch.randn(96, 64), torch.randn(32, 64)
    chosen = prepacked.choose_libraries([a, b, c, torch.randn(8, 8).bfloat16()], rows=8)
    bf16 = {"bfloat16 (8, 8) rows=8": "onednn"} if prepacked.onednn_supports(torch.bfloat16) else {}
    assert chosen == {"float32 (96, 64) rows=8": "onednn", "float32 (32, 64) rows=8": "onednn",
                      **bf16}                                       # bf16: oneDNN only (if at all), nothing to time
    per_shape = [lib for r in range(prepacked.TIMED_CALLS) for lib in (("mkl", "onednn"), ("onednn", "mkl"))[r % 2]]
    assert timed == per_shape * 2                                   # in turn, per fp32 shape, not per weight
    seconds.update(mkl=0.5)
    assert prepacked.choose_libraries([a], rows=8) == {"float32 (96, 64) rows=8": "mkl"}   # nothing remembered
    timed.clear()
    assert prepacked.choose_libraries([a, c], rows=8, tune=False) == {"float32 (96, 64) rows=8": "mkl",
                                                                      "float32 (32, 64) rows=8": "mkl"}
    assert timed == []                                              # skipped: MKL, F.linear's bits, untimed


@needs_mkl
def test_an_engine_built_without_tuning_times_nothing_and_records_its_choice(monkeypatch):
    monkeypatch.setattr(prepacked, "seconds_of_one_call", lambda packed, x: pytest.fail("timed"))
    llm = tiny_llm(max_num_seqs=4, tune_kernels=False)
    runner = llm.engine.runner
    assert runner.gemm_libraries and set(runner.gemm_libraries.values()) == {"mkl"}
    assert {p.library for layer in runner.packed_layers for p in layer} == {"mkl"}
    with pytest.raises(ValueError, match="tune_kernels = 'no'; allowed: True or False"):
        tiny_llm(tune_kernels="no")


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 16, 48])
def test_bf16_prepacked_gemm_matches_f_linear_to_bf16_rounding(rows):
    torch.manual_seed(0)
    w, x = torch.randn(96, 64).bfloat16(), torch.randn(rows, 64).bfloat16()
    packed = prepacked.PrepackedLinear(w, rows=16, library="onednn")
    exact = x.float() @ w.float().t()                                     # (N, out) in fp32
    assert (packed(x).float() - exact).abs().max() <= 2 ** -7 * exact.abs().max()


def test_what_cannot_be_prepacked_is_refused_clearly():
    with pytest.raises(ValueError, match="cannot prepack"):
        prepacked.PrepackedLinear(torch.randn(4, 4, requires_grad=True), rows=4, library="mkl")
    with pytest.raises(ValueError, match="cannot prepack"):
        prepacked.PrepackedLinear(torch.randn(4, 4).to(torch.int8), rows=4, library="mkl")
    with pytest.raises(ValueError, match="rows = 0"):
        prepacked.PrepackedLinear(torch.randn(4, 4), rows=0, library="mkl")
    with pytest.raises(ValueError, match="cannot prepack a torch.bfloat16"):
        prepacked.PrepackedLinear(torch.randn(4, 4).bfloat16(), rows=4, library="mkl")
    assert prepacked.prepack_or_none(torch.nn.Linear(4, 4, bias=True), 4, {}) is None   # bias: F.linear keeps it


def tiny_llm(dtype=torch.float32, **kwargs):
    model = random_model(tiny_config(), seed=0).to(dtype)
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=256, **kwargs)


@needs_mkl
def test_engine_runs_prepacked_gemms_and_gives_the_unpacked_tokens(monkeypatch):
    """Every step of more rows than a small step runs every GEMM prepacked (a small step reads the weights in row
    blocks instead: model/cpu_gemm.py); the tokens are the unpacked engine's."""
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 17, 40, 9, 25, 1, 12, 30, 7, 5], 200)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = tiny_llm(max_num_seqs=10)
    runner = plain.engine.runner
    runner.drop_prepacked()
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]

    llm = tiny_llm(max_num_seqs=10)
    runner = llm.engine.runner
    assert len(runner.packed_layers) == llm.config.n_layers and runner.packed_head is not None
    assert all(p is not None and p.rows == 10 for layer in runner.packed_layers for p in layer)
    calls = []
    original = prepacked.PrepackedLinear.__call__
    monkeypatch.setattr(prepacked.PrepackedLinear, "__call__", lambda self, x: calls.append(x.shape[0]) or original(self, x))
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    steps = [s for s in llm.engine.step_log if s["num_tokens"] > runner.small_step_rows]
    assert len(calls) == len(steps) * (4 * llm.config.n_layers + 1)       # every GEMM of every such step, and the head
    assert 10 in calls                                                     # the full decode batch ran packed


@needs_onednn_bf16
def test_bf16_engine_prepacked_logits_match_unpacked():
    llm, plain = tiny_llm(torch.bfloat16, max_num_seqs=4), tiny_llm(torch.bfloat16, max_num_seqs=4)
    runner = plain.engine.runner
    runner.drop_prepacked()
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 30, 12, 2], 200)]
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=5)
    a = llm.generate(prompts, params, use_tqdm=False)
    b = plain.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.packed_layers[0][0].library == "onednn"
    for x, y in zip(a, b):
        top_a, top_b = x.outputs[0].logprobs[0], y.outputs[0].logprobs[0]
        shared = set(top_a) & set(top_b)
        assert len(shared) >= 4
        assert max(abs(top_a[t].logprob - top_b[t].logprob) for t in shared) < 0.05


def test_a_cpu_without_onednns_bf16_gemm_runs_a_bf16_engine_unpacked(monkeypatch):
    """An AVX2-only CPU (the AMD EPYC 7003 VM): oneDNN refuses to lay out a bf16 weight, so the engine
    builds with F.linear for every bf16 GEMM instead of failing inside its build."""
    monkeypatch.setattr(prepacked, "onednn_supports", lambda dtype: dtype == torch.float32)
    llm = tiny_llm(torch.bfloat16, max_num_seqs=4)
    runner = llm.engine.runner
    assert runner.gemm_libraries == {} and runner.packed_head is None
    assert all(p is None for layer in runner.packed_layers for p in layer)
    with pytest.raises(ValueError, match="cannot prepack a torch.bfloat16 weight"):
        prepacked.PrepackedLinear(torch.randn(4, 4).bfloat16(), rows=4, library="onednn")
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_quantised_model_runs_unpacked():
    from minillm.quant import quantize_model

    llm = tiny_llm(max_num_seqs=4)
    quantize_model(llm.model, "int8")
    assert llm.engine.runner.packed_layers is None and llm.engine.runner.packed_head is None


def test_bf16_engine_attends_in_fp32_on_cpu(monkeypatch):
    """attention.sdpa: the 2-byte CPU attention runs torch's fp32 kernel on upcast q, K, V (the
    bf16 kernel is the slower one there) and hands back the model's dtype."""
    from minillm.attention import backends as attention

    seen = []
    original = F.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        return original(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    llm = tiny_llm(torch.bfloat16, max_num_seqs=4)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([5, 30, 12, 2], 200)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert seen and set(seen) == {(torch.float32,) * 3}

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 1, 8).bfloat16(), torch.randn(2, 3, 20, 8).bfloat16(), torch.randn(2, 3, 20, 8).bfloat16()
    out = attention.sdpa(q, k, v)                                      # (2, 6, 1, 8)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, original(q.float(), k.float(), v.float(), enable_gqa=True).bfloat16())


def test_fp16_engine_runs_on_any_cpu_and_prepacks_only_where_onednn_has_fp16():
    """oneDNN's fp16 GEMM needs AVX-512 FP16 or AVX-NE-CONVERT: elsewhere the fp16 weights stay plain F.linear."""
    supported = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    assert prepacked.libraries_for(torch.randn(4, 4).half()) == (["onednn"] if supported else [])
    llm = tiny_llm(torch.float16, max_num_seqs=2)
    out = llm.generate([{"prompt_token_ids": p} for p in random_prompts([5, 9], 200)],
                       SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert (llm.engine.runner.packed_layers[0][0] is not None) == supported
