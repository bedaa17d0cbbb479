"""The few-row GEMM over weights in row blocks (model/cpu_gemm.c) against the plain sum, and the engine's small
step that runs it: 1 to SMALL_STEP_ROWS rows (decode rows of several requests, a speculative verification, a
short prompt) through the compiled layer with the eager layer's fp32 tokens; where the kernel cannot be built,
the reason is kept and the small step takes one row only."""
import pytest
import torch

from helpers import CharTokenizer, random_prompts
from minillm import LLM, SamplingParams
from minillm.model import cpu_gemm
from minillm.model.llama import random_model, tiny_config
from minillm.model.runner import SMALL_STEP_ROWS
from minillm.model.transforms import gemv_blocks

pytestmark = pytest.mark.skipif(cpu_gemm.kernel()[0] is None, reason=f"no C kernel here: {cpu_gemm.kernel()[1]}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("out_features, in_features", [(96, 80), (32, 1), (512, 33)])
def test_the_kernel_is_the_sum_in_fp32_rounded_once(dtype, rows, out_features, in_features):
    """Every output is the fp32 sum of its products (exact in fp32), rounded to the dtype: within fp32's summing
    error of the exact sum, and in bf16 within one step of bf16 of it; 9 and 17 rows take the block again, 8
    rows at a time."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    (blocks,) = gemv_blocks([w])
    got = cpu_gemm.blocked_gemm(x, blocks)
    exact = x.double() @ w.double().t()                                           # (rows, out)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-5 * in_features ** 0.5, rtol=1e-5)
    else:                                                                         # one rounding of an fp32 sum
        torch.testing.assert_close(got.double(), exact, atol=1e-5 * in_features ** 0.5, rtol=2 ** -7)


def test_as_an_op_inside_a_compiled_graph_it_gives_the_eager_bits():
    w, x = torch.randn(64, 48).bfloat16(), torch.randn(5, 48).bfloat16()
    (blocks,) = gemv_blocks([w])
    linear = cpu_gemm.BlockedLinear(blocks)
    compiled = torch.compile(lambda x: torch.relu(linear(x)) + 1, dynamic=False)
    assert torch.equal(compiled(x), torch.relu(cpu_gemm.blocked_gemm(x, blocks)) + 1)


def test_bad_input_is_refused_by_name():
    (blocks,) = gemv_blocks([torch.randn(32, 16)])
    with pytest.raises(ValueError, match=r"blocked_gemm takes x \(N, in\)"):
        cpu_gemm.blocked_gemm(torch.randn(2, 15), blocks)                         # in differs
    with pytest.raises(ValueError, match="fp32 with R = 16"):
        cpu_gemm.blocked_gemm(torch.randn(2, 16).bfloat16(), blocks)              # dtypes differ
    with pytest.raises(ValueError, match="one dtype"):
        cpu_gemm.blocked_gemm(torch.randn(2, 16).half(), blocks.half())           # fp16: not taken
    assert not cpu_gemm.supports(torch.randn(32, 16))                             # not in row blocks


def engine(seed: int = 0, **options) -> LLM:
    return LLM(model=random_model(tiny_config(), seed=seed), tokenizer=CharTokenizer(), max_model_len=128,
               tune_kernels=False, **options)


def test_small_steps_of_several_requests_and_short_prompts_run_compiled_with_the_eager_tokens():
    """Up to SMALL_STEP_ROWS rows a step runs the compiled small step: 2-6 requests decoding together, and
    prompts of 3-8 tokens whose prefill is a small step too; fp32 tokens equal to the eager layer's."""
    llm = engine()
    runner = llm.engine.runner
    assert runner.small_step_rows == SMALL_STEP_ROWS == 8
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 8, 5, 20, 7, 4], 50, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    small = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    steps = runner.compiled_decode_steps
    assert steps >= params.max_tokens - 1                                    # every decode step of the six
    runner.decode_weights = None                                             # the eager layer instead
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == small
    assert runner.compiled_decode_steps == steps


def test_a_speculative_verification_is_one_small_step_with_the_plain_tokens():
    """n-gram drafts make runs of 1 + k rows of one request: each run is verified by one compiled small step
    (each row attends up to its own position), and the greedy tokens are the plain engine's."""
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = engine(seed=5).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    llm = engine(seed=5, speculative_method="ngram", num_speculative_tokens=3, speculative_policy="always")
    runner, rows = llm.engine.runner, []
    forward = runner._decode_layers
    runner._decode_layers = lambda batch: rows.append(batch.tokens.shape[0]) or forward(batch)
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == plain
    assert max(rows) > 1 and sum(s["num_draft_tokens"] for s in llm.engine.step_log) > 0    # drafts verified compiled


def test_where_the_kernel_cannot_be_built_it_says_why_and_the_small_step_takes_one_row(monkeypatch, tmp_path):
    prompts = [{"prompt_token_ids": p} for p in random_prompts([12, 9], 50, seed=2)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in engine().generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("CC", "false")                                        # a compiler that always fails
    monkeypatch.setattr(cpu_gemm, "library_path", lambda: tmp_path / "cpu_gemm.so")
    cpu_gemm.kernel.cache_clear()
    try:
        lib, why = cpu_gemm.kernel()
        assert lib is None and "cc failed" in why
        llm = engine()
        runner = llm.engine.runner
        assert runner.small_step_rows == 1 and not isinstance(runner.decode_weights[0][1], cpu_gemm.BlockedLinear)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == want
        assert runner.compiled_decode_steps == 0                              # two rows a step: the batched step
        llm.generate(prompts[:1], params, use_tqdm=False)
        assert runner.compiled_decode_steps == params.max_tokens - 1          # one row a step: compiled
        with pytest.raises(RuntimeError, match="few-row GEMM kernel is not available here: cc failed"):
            cpu_gemm.blocked_gemm(torch.randn(1, 16), gemv_blocks([torch.randn(16, 16)])[0])
    finally:
        cpu_gemm.kernel.cache_clear()
