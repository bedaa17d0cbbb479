"""CUDA graphs for decode steps (minillm/model/cuda_graphs.py): padded replays give the eager step's tokens.

On CPU the graph's forward (run_padded_decode over static, padded buffers) runs unrecorded on the
Triton paged path under TRITON_INTERPRET=1 (ModelRunner(triton_on_cpu=True)): the tests prove that
padding rows change no real row's logits and write no K/V, that stale rows of a larger earlier step
become padding, the bucket choice, and when the engine falls back to eager steps. A stand-in for
torch.cuda's graph API checks DecodeGraphs' side of recording (once per bucket, a warm-up that
writes no K/V, the output copied out); the real recording and replay (torch.cuda.CUDAGraph) are
proven only by the CUDA tests at the end.
"""
import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import CharTokenizer, alone, random_prompts
from minillm import LLM, SamplingParams
from minillm.config import SpeculativeConfig
from minillm.engine.engine import Engine
from minillm.kernel_support.args import INTERPRETED
from minillm.model.cuda_graphs import DecodeGraphs, batch_buckets, bucket_for
from minillm.model.llama import random_model, tiny_config
from minillm.model.positions import RopeTable
from minillm.model.runner import ModelRunner, PagedKVCache, build_batch
from minillm.model.transforms import fuse_projections
from minillm.speculative.engine import EngineSpeculation

CUDA = torch.cuda.is_available()
interpreter = pytest.mark.skipif(not INTERPRETED, reason="the Triton path on CPU needs TRITON_INTERPRET=1")


def cuda_only(test):
    """The `cuda` marker (tools/gpu_check.py runs these) and a skip on a machine without CUDA."""
    return pytest.mark.cuda(pytest.mark.skipif(not CUDA, reason="CUDA graphs are recorded only on a GPU")(test))


PROMPT_LENGTHS = [1, 5, 17, 33, 3, 40, 9]
MAX_TOKENS = [3, 14, 6, 20, 1, 9, 12]          # requests finish at different steps: the batch shrinks


def tiny_llm(device="cpu", triton_on_cpu=False, **kwargs):
    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), device=device,
              max_model_len=256, **kwargs)
    if triton_on_cpu:          # the engine the LLM would build, on the Triton path on CPU
        llm._engine = Engine(llm, triton_on_cpu=True)
    return llm


def workload(vocab, lengths=PROMPT_LENGTHS, max_tokens=MAX_TOKENS):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, vocab)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def record_buckets(runner) -> list:
    """Wrap runner.graphs.run to record each padded step's batch size."""
    sizes, run = [], runner.graphs.run
    runner.graphs.run = lambda batch: sizes.append(batch.tokens.shape[0]) or run(batch)
    return sizes


# ---------------------------------------------------------------------------- buckets, arguments

def test_buckets_follow_vllm_and_pad_at_most_seven_rows():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    buckets = batch_buckets(64)
    for n in range(1, 65):
        b = bucket_for(buckets, n)
        assert b >= n and b - n <= 7 and all(c < n for c in buckets if c < b)   # the smallest that fits


@pytest.mark.parametrize("bad", ["yes", 1, None, 0.0])
def test_enforce_eager_must_be_a_bool(bad):
    with pytest.raises(ValueError, match="enforce_eager"):
        tiny_llm(enforce_eager=bad)


def test_triton_on_cpu_needs_the_interpreter():
    """Without TRITON_INTERPRET=1 the kernels cannot take CPU tensors: a clear error, not a crash later."""
    code = ("from minillm.model.llama import random_model, tiny_config\n"
            "from minillm.model.runner import ModelRunner, PagedKVCache\n"
            "from minillm.model.positions import RopeTable\n"
            "cfg = tiny_config()\n"
            "try:\n"
            "    ModelRunner(random_model(cfg), PagedKVCache(cfg, 4, 4), RopeTable(16, 1e4, 16, 'cpu'),\n"
            "                triton_on_cpu=True)\n"
            "except ValueError as e:\n"
            "    print(e)\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert "TRITON_INTERPRET=1" in out.stdout, out.stderr


def test_cpu_gather_path_has_no_graphs():
    llm = tiny_llm()
    assert llm.engine.runner.graphs is None and llm.engine.runner.graph_replays == 0


# ---------------------------------------------------------------------------- the padded forward

def paged_setup(batch_size, block_size=4, num_blocks=64, seed=0):
    """A runner on the Triton path over a cache full of random K/V (as if earlier tokens were
    there), and a decode batch of batch_size requests of different lengths with disjoint blocks."""
    model = fuse_projections(random_model(tiny_config(), seed=0))
    cfg = model.cfg
    kv = PagedKVCache(cfg, num_blocks, block_size)
    gen = torch.Generator().manual_seed(seed)
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    runner = ModelRunner(model, kv, RopeTable(cfg.head_dim, cfg.rope_theta, 256, "cpu"), triton_on_cpu=True)
    order = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()   # block 0: what padding reads
    runs = []
    for i, start in enumerate([3, 17, 40, 1, 8, 25, 12, 30][:batch_size]):
        n = start // block_size + 1
        table, order = order[:n], order[n:]
        slot = table[start // block_size] * block_size + start % block_size
        runs.append(([int(torch.randint(3, cfg.vocab_size, (), generator=gen))], start, table, [slot]))
    batch = build_batch(runs, ["last"] * batch_size, block_size, "cpu", group_cost=None)
    return runner, batch, 256 // block_size


def slots_changed(before: PagedKVCache, after: PagedKVCache) -> set:
    """Slots (block * block_size + row) whose K or V differs in any layer."""
    k = (before.k != after.k).flatten(3).any(-1).any(0)                 # (num_blocks, block_size)
    v = (before.v != after.v).flatten(3).any(-1).any(0)
    return set((k | v).flatten().nonzero().flatten().tolist())


def clone_cache(kv: PagedKVCache) -> PagedKVCache:
    copy = PagedKVCache.__new__(PagedKVCache)
    copy.__dict__.update(kv.__dict__, k=kv.k.clone(), v=kv.v.clone())
    return copy


def assert_same_step(padded, eager, cache, eager_cache):
    """The padded step's logits and K/V against the eager step's. Not bit for bit: a GEMM library may
    block M = 3 rows differently from the bucket's M = 4 and sum in another order (MKL does on the
    2-core AMD EPYC VM, not on the Xeon one), so: equal to fp32 rounding, and the same greedy tokens."""
    torch.testing.assert_close(padded, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(padded.argmax(-1), eager.argmax(-1))
    torch.testing.assert_close(cache.k, eager_cache.k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v, eager_cache.v, rtol=1e-5, atol=1e-5)


@interpreter
@pytest.mark.parametrize("batch_size", [1, 3, 5, 8])
def test_padded_decode_matches_the_eager_step_and_writes_only_real_slots(batch_size):
    runner, batch, max_blocks = paged_setup(batch_size)
    before = clone_cache(runner.kv)
    eager = runner.forward_eager(batch)                                  # (B, V)
    eager_cache = clone_cache(runner.kv)
    runner.kv.k.copy_(before.k), runner.kv.v.copy_(before.v)
    graphs = DecodeGraphs(runner, max_num_seqs=8, max_blocks=max_blocks)   # buckets 1, 2, 4, 8
    padded = graphs.run(batch)
    assert graphs.padded_steps == 1 and graphs.replays == 0              # no recording on CPU
    real = set(batch.slot_mapping.tolist())
    assert slots_changed(before, runner.kv) == real                      # padding rows wrote nothing
    assert_same_step(padded, eager, runner.kv, eager_cache)


@interpreter
def test_rows_of_a_larger_earlier_step_become_padding():
    """A 7-row step then a 3-row one: rows 3..7 of the static buffers held real slots; the
    smaller step must not write through them again (bucket 4 reads row 3)."""
    runner, big, max_blocks = paged_setup(7)
    graphs = DecodeGraphs(runner, max_num_seqs=8, max_blocks=max_blocks)
    graphs.run(big)
    _, small, _ = paged_setup(3, seed=1)                               # other requests, same runner
    small_runner_cache = clone_cache(runner.kv)
    out = graphs.run(small)
    assert out.shape[0] == 3
    assert slots_changed(small_runner_cache, runner.kv) <= set(small.slot_mapping.tolist())
    assert graphs.inputs.slots[3].item() == -1 and graphs.inputs.lens[3].item() == 1   # bucket 4's padding row


@interpreter
def test_only_decode_only_steps_take_the_padded_path():
    runner, batch, max_blocks = paged_setup(3)
    graphs = DecodeGraphs(runner, max_num_seqs=8, max_blocks=max_blocks)
    assert graphs.fits(batch)
    mixed = build_batch([([5, 6, 7], 0, [9], [36, 37, 38]), ([8], 4, [10, 11], [44])], ["last", "last"], 4,
                        "cpu", group_cost=None)
    assert not graphs.fits(mixed)                                        # a prefill chunk: eager
    no_logits = build_batch([([8], 4, [10, 11], [44])], ["none"], 4, "cpu", group_cost=None)
    assert not graphs.fits(no_logits)                                    # a 1-token prefill chunk
    too_many = build_batch([([8], 4, [10, 11], [44])] * 9, ["last"] * 9, 4, "cpu", group_cost=None)
    assert not graphs.fits(too_many)                                     # over max_num_seqs


class StandInGraphs:
    """torch.cuda's graph API played on CPU: a "recording" notes which padded forward ran inside it
    and the tensor it returned; replay() runs that forward again into the same tensor. What this
    proves is DecodeGraphs' side of the contract: capture once per bucket, warm up without writing
    K/V, load the inputs only after recording, read the recorded output, copy it out."""

    def __init__(self, monkeypatch):
        self.recording, self.warmups, self.captures = None, 0, []
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "Stream", lambda: StandInStream())
        monkeypatch.setattr(cuda, "current_stream", lambda: StandInStream())
        monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "CUDAGraph", StandInGraph)
        monkeypatch.setattr(cuda, "graph", self.graph)
        import minillm.model.cuda_graphs as cg
        run = cg.run_padded_decode

        def padded(runner, inputs, bucket):
            out = run(runner, inputs, bucket)
            if self.recording is None:
                self.warmups += 1
            else:
                self.recording.forward = lambda: out.copy_(run(runner, inputs, bucket))
            return out
        monkeypatch.setattr(cg, "run_padded_decode", padded)

    @contextlib.contextmanager
    def graph(self, graph, pool=None):
        self.recording = graph
        self.captures.append(pool)
        yield
        self.recording = None


class StandInStream:
    def wait_stream(self, other):
        pass


class StandInGraph:
    def replay(self):
        self.forward()

    def pool(self):
        return "pool"


@interpreter
def test_recording_logic_with_a_stand_in_for_cuda_graphs(monkeypatch):
    fake = StandInGraphs(monkeypatch)
    runner, big, max_blocks = paged_setup(7)
    graphs = DecodeGraphs(runner, max_num_seqs=8, max_blocks=max_blocks)
    graphs.record = True                                                 # as on CUDA
    before = clone_cache(runner.kv)
    eager = runner.forward_eager(big)
    eager_cache = clone_cache(runner.kv)
    runner.kv.k.copy_(before.k), runner.kv.v.copy_(before.v)
    padded = graphs.run(big)                                             # records bucket 8, then replays
    assert fake.warmups == 2 and list(graphs.graphs) == [8] and graphs.replays == 1
    assert_same_step(padded, eager, runner.kv, eager_cache)
    assert padded.data_ptr() != graphs.graphs[8][1].data_ptr()          # a copy, not the graph's buffer
    graphs.run(big)
    assert fake.warmups == 2 and graphs.replays == 2                    # recorded once per bucket
    _, small, _ = paged_setup(3, seed=1)
    cache = clone_cache(runner.kv)
    out = graphs.run(small)                                              # records bucket 4 in the same pool
    assert out.shape[0] == 3 and sorted(graphs.graphs) == [4, 8] and fake.captures == [None, "pool"]
    assert slots_changed(cache, runner.kv) <= set(small.slot_mapping.tolist())   # warm-up and padding wrote nothing


# ---------------------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def reference():
    """Each request alone on the contiguous cache (the definition of right, tests/engine/test_engine.py)."""
    llm = tiny_llm()
    prompts, params = workload(llm.config.vocab_size)
    return alone(llm, prompts, params)


@interpreter
def test_engine_with_padded_decode_steps_equals_reference(reference):
    llm = tiny_llm(triton_on_cpu=True, max_num_seqs=8)
    runner = llm.engine.runner
    sizes = record_buckets(runner)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert runner.graphs.padded_steps == len(sizes) > 0 and runner.graph_replays == 0
    used = {bucket_for(runner.graphs.buckets, n) for n in sizes}
    assert len(used) >= 3                                                # the batch shrank across buckets
    assert len(sizes) < len(llm.engine.step_log)                         # prefill steps stayed eager


@interpreter
def test_enforce_eager_runs_without_the_padded_path(reference):
    llm = tiny_llm(triton_on_cpu=True, max_num_seqs=8, enforce_eager=True)
    assert llm.engine.runner.graphs is None
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference


@interpreter
def test_quantised_kv_and_speculation_fall_back_to_eager():
    llm = tiny_llm(triton_on_cpu=True, kv_cache_dtype="int8")
    assert not llm.engine.runner.use_triton and llm.engine.runner.graphs is None
    prompts, params = workload(llm.config.vocab_size, [5, 9], [4, 4])
    assert all(len(t) == 4 for t in tokens(llm.generate(prompts, params, use_tqdm=False)))
    llm = tiny_llm(speculative_method="ngram")
    spec = EngineSpeculation(llm, SpeculativeConfig("ngram", 3))
    engine = Engine(llm, speculation=spec, triton_on_cpu=True)
    assert engine.runner.use_triton and engine.runner.graphs is None


# ---------------------------------------------------------------------------- CUDA only

def generate_both(make_llm, prompts, params):
    """-> (tokens with graphs, tokens with enforce_eager=True, the graph LLM's runner, batch sizes it padded)."""
    graphs = make_llm(enforce_eager=False)
    sizes = record_buckets(graphs.engine.runner)
    with_graphs = tokens(graphs.generate(prompts, params, use_tqdm=False))
    eager = tokens(make_llm(enforce_eager=True).generate(prompts, params, use_tqdm=False))
    return with_graphs, eager, graphs.engine.runner, sizes


@cuda_only
@pytest.mark.parametrize("max_num_seqs", [3, 8, 64])
def test_cuda_graphs_give_the_eager_tokens_tiny(max_num_seqs):
    prompts, params = workload(tiny_config().vocab_size)
    make = lambda **kw: tiny_llm("cuda", max_num_seqs=max_num_seqs, **kw)   # noqa: E731
    with_graphs, eager, runner, sizes = generate_both(make, prompts, params)
    assert with_graphs == eager
    assert runner.graph_replays == len(sizes) > 0
    assert len({bucket_for(runner.graphs.buckets, n) for n in sizes}) >= 2   # shrank across buckets
    assert set(runner.graphs.graphs) <= set(runner.graphs.buckets)


@cuda_only
def test_cuda_graphs_int8_kv_falls_back_to_eager():
    llm = tiny_llm("cuda", kv_cache_dtype="int8")
    prompts, params = workload(llm.config.vocab_size, [5, 9], [4, 4])
    llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.runner.graphs is None and llm.engine.runner.graph_replays == 0


@cuda_only
def test_cuda_graphs_give_the_eager_tokens_smollm2(smollm2_path):
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colours are"]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (24, 40, 8, 16)]

    def make(**kw):
        return LLM(model=str(smollm2_path), dtype="float32", device="cuda", max_model_len=512, **kw)
    with_graphs, eager, runner, sizes = generate_both(make, prompts, params)
    assert with_graphs == eager
    assert runner.graph_replays == len(sizes) > 0


@cuda_only
def test_cuda_graphs_replay_the_int4_gemv_and_give_the_eager_tokens(monkeypatch):
    """4-bit weights under graphs: the split-K GEMV (and its partial-sum kernel) recorded and replayed."""
    import kernels.w4a16_gemv as gemv_module
    from helpers import count_calls

    gemv_calls = count_calls(monkeypatch, "w4a16_gemv", gemv_module)
    prompts, params = workload(tiny_config().vocab_size)
    make = lambda **kw: tiny_llm("cuda", max_num_seqs=4, quantization="int4", **kw)  # noqa: E731
    with_graphs, eager, runner, sizes = generate_both(make, prompts, params)
    assert with_graphs == eager
    assert runner.graph_replays == len(sizes) > 0 and len(gemv_calls) > 0
