"""Every request takes one path: LLM -> engine -> runner -> one decoder layer -> one attention backend.

A profiler hook lists the minillm modules a warmed greedy decode enters, from LLM.generate of one
prompt, of several, and from LLM.stream: the same list, the engine in it, no teaching stage
(the contiguous cache, the batch-1 fast loop, the per-request speculative loop) on it; and below
ModelRunner.forward only the runner, the layer (with RoPE), the model's own modules, the GEMM and one
attention backend.
"""
import inspect
import sys

import pytest
import torch

from helpers import TEACHING_STAGES, CharTokenizer, modules_entered, random_prompts, symbols_created
from minillm import LLM, SamplingParams
from minillm.model.llama import random_model, tiny_config
from minillm.model.cpu_gemm import BlockedLinear
from minillm.model.runner import ModelRunner
from minillm.stages.reference import stream_contiguous

BELOW_THE_RUNNER = {"minillm.model.runner", "minillm.model.layer", "minillm.model.positions", "minillm.model.llama", "minillm.model.prepacked",
                    "minillm.attention.backends", "minillm.attention.paged", "minillm.attention.cpu_decode",
                    "minillm.model.cpu_gemm"}


@pytest.fixture(scope="module")
def warmed():
    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=0), tokenizer=CharTokenizer(), max_model_len=128)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([12, 30, 7], cfg.vocab_size)]   # the first > SMALL_STEP_ROWS
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)                     # compiles, allocates
    llm.generate(prompts[:1], params, use_tqdm=False)
    return llm, prompts, params


def test_one_prompt_many_prompts_and_stream_enter_the_same_modules(warmed):
    llm, prompts, params = warmed
    one = modules_entered(lambda: llm.generate(prompts[:1], params, use_tqdm=False))
    many = modules_entered(lambda: llm.generate(prompts, params, use_tqdm=False))
    streamed = modules_entered(lambda: list(llm.stream(prompts[0], params)))
    # a small step (a lone decode row, or the three requests' decodes) runs in the compiled step's graph, the
    # projections of one row as generated loops, of several by the few-row kernel (model.cpu_gemm); a step that
    # mixes a prefill with decodes attends its decode rows in one call of the backend's kernel
    # (attention.cpu_decode): the differences
    assert one == streamed and many - one <= {"minillm.attention.cpu_decode", "minillm.model.cpu_gemm"} and one <= many
    assert {"minillm.llm", "minillm.engine.engine", "minillm.engine.scheduler", "minillm.kvcache.block_manager",
            "minillm.model.runner", "minillm.model.layer", "minillm.engine.output_processor"} <= one
    assert not one & TEACHING_STAGES


def test_below_the_runner_only_the_layer_the_model_and_one_attention_backend(warmed):
    llm, prompts, params = warmed
    below = modules_entered(lambda: llm.generate(prompts, params, use_tqdm=False), inspect.unwrap(ModelRunner.forward).__code__)
    assert {"minillm.model.layer", "minillm.attention.backends", "minillm.attention.paged"} <= below
    assert below <= BELOW_THE_RUNNER, below - BELOW_THE_RUNNER
    assert llm.engine.runner.attention.name == "cpu"                           # the one backend of this path


def test_one_prompt_decodes_on_the_engines_compiled_step_with_the_tokens_of_every_other_way(warmed):
    """generate([p]), generate of several, stream(p) and p alone on the contiguous cache: the same
    greedy tokens in fp32; the lone prompt's decode steps ran the runner's compiled layer."""
    llm, prompts, params = warmed
    runner = llm.engine.runner
    before = runner.compiled_decode_steps
    (one,) = llm.generate(prompts[:1], params, use_tqdm=False)
    assert runner.compiled_decode_steps - before == params.max_tokens - 1      # every step after the prompt's
    many = llm.generate(prompts, params, use_tqdm=False)
    text = "".join(llm.stream(prompts[0], params))
    (req,) = llm.make_requests([prompts[0]], params)
    alone = "".join(stream_contiguous(llm, req))
    assert one.outputs[0].token_ids == many[0].outputs[0].token_ids == req.output_token_ids
    assert one.outputs[0].text == text == alone


def test_the_compiled_step_falls_back_to_eager_when_the_compiler_fails_and_says_why(monkeypatch):
    """A compiler failure (not a bug of the step) is recorded on the runner, warned once, and the same
    layer runs eagerly: the tokens do not change."""
    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=1), tokenizer=CharTokenizer(), max_model_len=64, tune_kernels=False)
    prompt = {"prompt_token_ids": random_prompts([9], cfg.vocab_size)[0]}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.runner

    def broken(*args):
        raise torch._dynamo.exc.TorchRuntimeError("no C++ compiler")
    monkeypatch.setattr("minillm.model.runner.compiled_decode_layer", broken)
    with pytest.warns(UserWarning, match="could not build"):
        got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == want and "no C++ compiler" in runner.compile_failed


def test_an_error_inside_the_compiled_step_is_the_steps_own(monkeypatch):
    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=1), tokenizer=CharTokenizer(), max_model_len=64, tune_kernels=False)
    prompt = {"prompt_token_ids": random_prompts([9], cfg.vocab_size)[0]}

    def buggy(*args):
        raise IndexError("a bug in the step, not the compiler")
    monkeypatch.setattr("minillm.model.runner.compiled_decode_layer", buggy)
    with pytest.raises(IndexError, match="not the compiler"):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert llm.engine.runner.compile_failed is None
    assert not llm.engine.requests                                             # aborted, blocks freed
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


# The sizes the runner marks symbolic: the block table's width and the KV pool's block count (small step), the
# step's row count (small step of 2 or more rows: h, cos, sin, slots, block tables, seq_lens; batched step: its rows
# h, their RoPE cos and sin, the attention output between the pieces).
MARKED_SIZES = ("L['block_tables'].size()[1]", "L['k_cache'].size()[0]", "L['v_cache'].size()[0]", "L['h'].size()[0]",
                "L['cos'].size()[0]", "L['sin'].size()[0]", "L['slots'].size()[0]", "L['block_tables'].size()[0]",
                "L['seq_lens'].size()[0]",
                "L['rope'].keywords['cos'].size()[0]", "L['rope'].keywords['sin'].size()[0]", "L['___stack0'].size()[0]")


def test_a_second_model_in_the_process_compiles_static_sizes(fresh_compile_caches):
    """Dynamo remembers sizes per function: without dynamic=False the second model's steps would have
    every size that differs from the first model's made symbolic (slower loops). Only the sizes the runner
    marks (MARKED_SIZES) may be symbols."""
    from torch._dynamo.utils import counters

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for cfg in (tiny_config(), tiny_config(dim=64, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128)):
        llm = LLM(model=random_model(cfg, seed=0), tokenizer=CharTokenizer(), device="cpu", max_model_len=64)
        graphs = counters["stats"]["unique_graphs"]
        with symbols_created() as symbols:
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
        assert llm._engine.runner.compiled_decode_steps > 0
    assert counters["stats"]["unique_graphs"] > graphs                      # the second model did compile
    assert symbols and all(any(f"for {size} " in s for size in MARKED_SIZES) for s in symbols), symbols


def test_importing_the_library_does_not_import_the_compiler_and_a_decode_still_compiles():
    """torch.compile imports Dynamo and Inductor (most of a process's start), so each compiled
    function is built at its first call: importing minillm, its CLI and its server costs none of it, and
    the first decode step on CPU still runs compiled."""
    import os
    import subprocess
    from pathlib import Path

    code = ("import sys, minillm, minillm.llm, minillm.stages.fast_decode, minillm.serving.server, minillm.__main__\n"
            "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))\n"
            "from helpers import CharTokenizer\n"
            "from minillm import LLM, SamplingParams\n"
            "from minillm.model.llama import random_model, tiny_config\n"
            "llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device='cpu', max_model_len=64)\n"
            "llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),"
            " use_tqdm=False)\n"
            "print(llm._engine.runner.compiled_decode_steps, 'torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["[]", "3 True"], done.stdout     # the 3-token prompt is a small step too


def test_options_the_compiler_refuses_run_the_fallback():
    from minillm.model.layer import compile_on_first_call

    def double(x):
        return 2 * x

    refused = compile_on_first_call(lambda x: x + 1, options={"no_such_inductor_option": 1}, fallback=double)
    assert refused(torch.tensor(3)) == 6
    with pytest.raises(RuntimeError, match="no_such_inductor_option"):
        compile_on_first_call(lambda x: x + 1, options={"no_such_inductor_option": 1})(torch.tensor(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_compiled_step_reads_each_float_weight_as_a_copy_in_row_blocks_of_one_cache_line(dtype):
    """transforms.gemv_blocks at the runner's build: block b, column i, lane r is row b*R + r of the
    weight, R weights to a 64-byte line; the tied head too. The step then decodes the tokens of the
    eager engine (fp32: equal)."""
    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=2).to(dtype), tokenizer=CharTokenizer(), max_model_len=64, tune_kernels=False)
    runner, model = llm.engine.runner, llm.model
    R = 64 // torch.tensor([], dtype=dtype).element_size()
    layer = model.layers[0]
    projections = [runner.decode_weights[0][i] for i in (1, 2, 4, 5)]
    assert all(isinstance(p, BlockedLinear) for p in projections)                 # read by the few-row kernel
    assert runner.small_step_rows > 1                                              # ... the head too (K > 1 rows)
    for blocks, linear in zip([p.blocks for p in projections],
                              [layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down]):
        out, n_in = linear.weight.shape
        assert blocks.shape == (out // R, n_in, R) and blocks.is_contiguous()
        assert torch.equal(blocks.transpose(1, 2).reshape(out, n_in), linear.weight)
        assert blocks.data_ptr() != linear.weight.data_ptr()                       # a copy: the original stays
    assert torch.equal(runner.decode_head.transpose(1, 2).reshape(cfg.vocab_size, cfg.dim), model.embed.weight)
    if dtype == torch.float32:
        prompt = {"prompt_token_ids": random_prompts([9], cfg.vocab_size, seed=3)[0]}
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        compiled = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
        assert runner.compiled_decode_steps == params.max_tokens - 1
        runner.decode_weights = None                                               # the eager layer instead
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == compiled


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_blocked_gemv_equals_the_row_wise_one_compiled_and_eager(dtype):
    from minillm.model.layer import compile_on_first_call, gemv
    from minillm.model.transforms import gemv_blocks

    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 80, generator=g).to(dtype)
    x = torch.randn(80, generator=g).to(dtype)
    odd = torch.randn(90, 80, generator=g).to(dtype)                             # not a whole number of blocks
    want = (w.double() @ x.double())
    compiled = compile_on_first_call(gemv, dynamic=False)
    blocks, same = gemv_blocks([w, odd])
    assert blocks.dim() == 3 and same is odd
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.01)   # bf16: one rounding
    for got in (compiled(blocks, x), compiled(w, x), gemv(blocks, x), gemv(w, x)):
        assert got.dtype == dtype and got.shape == (96,)
        torch.testing.assert_close(got.double(), want, **tol)


def test_the_row_blocks_live_in_huge_pages_where_linux_gives_them():
    """A decode step streams every weight once: gemv_blocks puts the copies in one fresh mapping advised for
    transparent huge pages, so the step crosses a page every 2 MB, not every 4 KB. Checked in this process
    after heap churn (freed chunks of the buffer's size, which malloc would hand back touched) and in a
    fresh one."""
    import os
    import subprocess
    from pathlib import Path

    from minillm.model.transforms import _thp_mode, gemv_blocks, huge_page_kb

    if not sys.platform.startswith("linux") or not ("[always]" in _thp_mode() or "[madvise]" in _thp_mode()):
        pytest.skip(f"transparent huge pages are off here ({_thp_mode().strip() or 'no THP'})")
    for _ in range(2):
        chunks = [torch.randn(5 << 20 >> 2) for _ in range(8)]
        del chunks
    weights = [torch.randn(1024, 1024) for _ in range(4)]                         # 16 MB of copies
    blocks = gemv_blocks(weights)
    assert all(torch.equal(b.transpose(1, 2).reshape(1024, 1024), w) for b, w in zip(blocks, weights))
    assert huge_page_kb(blocks[0]) >= 8 * 1024                                    # most of the 16 MB
    code = ("import torch\nfrom minillm.model.transforms import gemv_blocks, huge_page_kb\n"
            "print(huge_page_kb(gemv_blocks([torch.randn(1024, 1024) for _ in range(4)])[0]))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])})
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) >= 8 * 1024


def test_a_batched_step_runs_the_compiled_layer_with_the_tokens_of_the_eager_one(fresh_compile_caches):
    """Steps of more rows than a small step (prefill chunks beside decodes, then 9-12 decodes alone) run
    layer.compiled_layer, whose graphs hold everything but attention: the same fp32 tokens as the eager layer, and
    one set of graphs for every row count (the rows are the one symbolic size)."""
    from torch._dynamo.utils import counters

    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=3), tokenizer=CharTokenizer(), max_model_len=128, max_num_seqs=12,
              max_num_batched_tokens=24)
    runner = llm.engine.runner
    assert runner.compile_batched                                              # every projection is prepacked
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([7, 30, 12, 21] * 3, cfg.vocab_size, seed=5)]
    compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    steps, graphs = runner.compiled_batched_steps, counters["stats"]["unique_graphs"]
    assert steps > 10
    llm.generate(prompts[1:], params, use_tqdm=False)                         # other row counts
    assert counters["stats"]["unique_graphs"] == graphs and runner.compiled_batched_steps > steps
    runner.compile_batched = False
    eager_steps = runner.compiled_batched_steps
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert runner.compiled_batched_steps == eager_steps
    assert compiled == eager
    runner.drop_prepacked()
    assert not runner.compile_batched                                          # plain F.linear: the eager layer


def test_the_compiled_batched_step_falls_back_to_eager_when_the_compiler_fails(monkeypatch):
    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=4), tokenizer=CharTokenizer(), max_model_len=64, tune_kernels=False)
    prompts = [{"prompt_token_ids": p} for p in random_prompts([9, 5, 14], cfg.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    runner = llm.engine.runner

    def broken(*args):
        raise torch._dynamo.exc.TorchRuntimeError("no C++ compiler")
    monkeypatch.setattr("minillm.model.runner.compiled_layer", broken)
    steps = runner.compiled_batched_steps
    with pytest.warns(UserWarning, match="could not build"):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want and "no C++ compiler" in runner.compile_failed
    assert runner.compiled_batched_steps == steps + 1                       # the step that failed, then eager


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepacked_gemm_under_torch_compile_is_the_eager_one(dtype):
    """Inductor cannot open oneDNN's packed weight outside a frozen graph: the compiled step calls the GEMM as
    the op minillm::prepacked_linear, which must give the eager call's very bits."""
    from minillm.model.prepacked import PrepackedLinear, libraries_for

    libraries = libraries_for(torch.empty(1, 1, dtype=dtype))
    if not libraries:
        pytest.skip(f"no library prepacks {dtype} on this CPU")
    weight, x = torch.randn(48, 32).to(dtype), torch.randn(5, 32).to(dtype)
    for library in libraries:
        packed = PrepackedLinear(weight, 8, library)
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: packed(x) * 2, dynamic=False)
        assert torch.equal(compiled(x), packed(x) * 2), library
