"""LLM(..., tensor_parallel_size / pipeline_parallel_size): the continuous-batching engine over
worker processes gives the tokens and logprobs of one process, and no process outlives the LLM
(closed, a worker crashing, the driver interrupted or killed).

Starting worker processes costs seconds on a CPU, so each LLM is built once per class (one
process group at a time per process) and the test that ends it (close, crash) comes last.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from helpers import CharTokenizer, random_prompts
from minillm import LLM, SamplingParams
from minillm.model.llama import random_model, tiny_config
from minillm.parallel import comm
from minillm.parallel.workers import DistributedRunner

CFG = tiny_config(n_heads=6, n_kv_heads=3, vocab_size=250, n_layers=3)
ROOT = Path(__file__).resolve().parents[2]
# lengths that cross 16-token blocks; a step budget of 24 tokens forces chunked prefills
PROMPTS = [{"prompt_token_ids": p} for p in random_prompts([5, 17, 40, 3, 23], CFG.vocab_size, seed=7)]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
ENGINE = dict(max_model_len=128, device="cpu", max_num_batched_tokens=24, max_num_seqs=4)


def _tiny_llm(**kwargs) -> LLM:
    return LLM(model=random_model(CFG, seed=1), tokenizer=CharTokenizer(), **ENGINE, **kwargs)


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in state


def _wait_gone(pids, seconds: float = 15.0) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and any(map(_alive, pids)):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _tokens_and_logprobs(outs):
    return ([o.outputs[0].token_ids for o in outs],
            [[e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])


@pytest.fixture(scope="module")
def reference():
    return _tokens_and_logprobs(_tiny_llm().generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="class")
def tp_llm():
    llm = _tiny_llm(tensor_parallel_size=3)
    yield llm
    llm.close()


@pytest.fixture(scope="class")
def pp_llm():
    llm = _tiny_llm(pipeline_parallel_size=3)
    yield llm
    llm.close()


def _check_equal(llm, reference):
    tokens, logprobs = _tokens_and_logprobs(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert tokens == reference[0]
    for got, want in zip(logprobs, reference[1]):
        assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5


class TestTensorParallelEngine:
    def test_engine_with_tensor_parallel_3_equals_one_process(self, tp_llm, reference):
        comm.reset_counts()
        _check_equal(tp_llm, reference)
        assert isinstance(tp_llm.engine.runner, DistributedRunner)
        assert tp_llm.config.n_kv_heads == 1                     # rank 0 holds (and caches) one of the 3 KV heads
        steps = comm.COUNTS["all_gather.calls"]                   # one logits all-gather per engine step
        assert steps > 0 and comm.COUNTS["broadcast.calls"] == steps + 1   # one batch per step + the engine's start
        assert comm.COUNTS["all_reduce.calls"] == steps * (2 * CFG.n_layers + 1)
        every = tp_llm.parallel.counts()                          # each rank's own counter, gathered
        assert len(every) == 3 and all(c["all_reduce.bytes"] > 0 for c in every)
        assert len({c["all_reduce.bytes"] for c in every}) == 1  # an all-reduce: every rank hands over the same

    def test_stream_runs_on_the_workers(self, tp_llm):
        text = "".join(tp_llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)))
        assert len(text) == 5

    def test_close_leaves_no_worker_process(self, tp_llm):
        pids = [p.pid for p in tp_llm.parallel.processes]
        assert len(pids) == 2 and all(map(_alive, pids))
        tp_llm.close()
        assert _wait_gone(pids, 1.0) == []
        with pytest.raises(RuntimeError, match="closed"):
            tp_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)


class TestPipelineParallelEngine:
    def test_engine_with_pipeline_parallel_3_equals_one_process(self, pp_llm, reference):
        comm.reset_counts()
        _check_equal(pp_llm, reference)
        assert len(pp_llm.model.layers) == 1                      # rank 0 holds one of the 3 layers
        assert comm.COUNTS["send.calls"] > 0 and "all_reduce.calls" not in comm.COUNTS

    def test_a_crashed_worker_fails_the_step_and_nothing_is_left(self, pp_llm):
        pids = [p.pid for p in pp_llm.parallel.processes]
        os.kill(pids[-1], signal.SIGKILL)                        # the last stage dies
        with pytest.raises(RuntimeError, match="pipeline-parallel step failed"):
            pp_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        pp_llm.close()
        assert _wait_gone(pids) == []


def test_bad_sizes_are_refused_before_any_process_starts():
    before = multiprocessing.active_children()
    with pytest.raises(ValueError, match="allowed: one of them > 1"):
        _tiny_llm(tensor_parallel_size=3, pipeline_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size = 0 is invalid"):
        _tiny_llm(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="quantization=None"):
        _tiny_llm(tensor_parallel_size=3, quantization="int8")
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2 .*allowed: 1, 3"):
        _tiny_llm(tensor_parallel_size=2)
    assert multiprocessing.active_children() == before


DRIVER = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from helpers import CharTokenizer
    from minillm import LLM, SamplingParams
    from minillm.model.llama import random_model, tiny_config
    llm = LLM(model=random_model(tiny_config()), tokenizer=CharTokenizer(), max_model_len=512, device="cpu",
              tensor_parallel_size=2)
    print(*[p.pid for p in llm.parallel.processes], flush=True)
    while True:
        llm.generate([{{"prompt_token_ids": [5] * 300}}], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
""")


def test_driver_interrupted_or_killed_leaves_no_worker_process():
    """Two drivers at once (starting processes is the slow part): one gets Ctrl-C, one is killed."""
    script = DRIVER.format(root=str(ROOT), tests=str(ROOT / "tests"))
    drivers = {how: subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True)
               for how in (signal.SIGINT, signal.SIGKILL)}
    try:
        workers = {how: [int(p) for p in d.stdout.readline().split()] for how, d in drivers.items()}
        assert all(len(pids) == 1 for pids in workers.values())
        time.sleep(1.0)                                      # inside generate: a step is running
        for how, driver in drivers.items():
            driver.send_signal(how)
        for how, driver in drivers.items():
            driver.wait(timeout=30)
            assert _wait_gone(workers[how]) == [], how.name
    finally:
        for driver in drivers.values():
            driver.kill()


UNGUARDED = textwrap.dedent("""
    import sys
    sys.path[:0] = [{root!r}, {tests!r}]
    from helpers import CharTokenizer
    from minillm import LLM, SamplingParams
    from minillm.model.llama import random_model, tiny_config
    model = random_model(tiny_config())
    llm = LLM(model=model, tokenizer=CharTokenizer(), max_model_len=512, device="cpu", tensor_parallel_size=2)
    out = llm.generate([{{"prompt_token_ids": [5, 6, 7]}}], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    print("tokens", out[0].outputs[0].token_ids)
    llm.close()
""")


def test_a_script_without_a_main_guard_starts_a_parallel_llm(tmp_path):
    """The workers start without the caller's script (spawn would run it again in each of them, and a
    script that builds the LLM at the top would spawn without end): no `if __name__ == "__main__":` needed."""
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(root=str(ROOT), tests=str(ROOT / "tests")))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("tokens [") and len(run.stdout.split(",")) == 4


def test_a_module_of_another_class_is_refused_before_any_worker_starts():
    """The workers rebuild a plain Llama from config and weights: a subclass's own forward would run on rank 0 only."""
    from minillm.model.llama import Llama

    class Mine(Llama):
        pass

    with pytest.raises(ValueError, match="the module is a .*Mine.*Allowed: a minillm.model.llama.Llama"):
        LLM(model=Mine(tiny_config()), tokenizer=CharTokenizer(), max_model_len=64, device="cpu",
            tensor_parallel_size=2)
    assert not multiprocessing.active_children()


def test_a_worker_that_dies_before_joining_fails_the_start_at_once_and_says_why():
    """Rank 0 watches the spawned workers while it waits for them at the store: one that exits first fails the
    start at once, with its exit code, instead of leaving rank 0 to wait out the rendezvous."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from minillm.parallel.workers import _wait_until_joined

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    dead = mp.get_context("spawn").Process(target=os._exit, args=(3,), name="minillm-tensor-rank1")
    dead.start()
    dead.join(60)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="minillm-tensor-rank1 exited with code 3 before joining"):
        _wait_until_joined(store, [dead], "tensor")
    assert time.monotonic() - t0 < 5


HELD_OUT = ["The three primary colours are", "def fibonacci(n):", "Water boils at a temperature of",
            "Once upon a time, in a small village by the sea,"]


def test_smollm2_tensor_parallel_3_equals_one_process(smollm2_path):
    """The TP ranks multiply by plain F.linear (MKL's GEMM in fp32); the one-process engine prepacks its
    weights for the library timed faster per shape (minillm/model/prepacked.py): MKL's packed GEMM gives
    F.linear's bits, oneDNN's does not (as far apart in these logprobs as TP is). Which one wins is timed, so under the load of the full suite it can change from run to run:
    the reference here runs on the TP ranks' kernels, so that the only difference left is the one TP
    adds, the all-reduce summing three partial products in another order than one GEMM."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(model=str(smollm2_path), dtype="float32", device="cpu") as one:
        one.engine.runner.drop_prepacked()                              # F.linear, as on every TP rank
        want = _tokens_and_logprobs(one.generate(HELD_OUT, params, use_tqdm=False))
    with LLM(model=str(smollm2_path), dtype="float32", device="cpu", tensor_parallel_size=3) as tp:
        assert tp.config.n_heads == 3 and tp.config.n_kv_heads == 1    # 9 query, 3 KV heads over 3 ranks
        assert tp.engine.runner.packed_layers is None
        got = _tokens_and_logprobs(tp.generate(HELD_OUT, params, use_tqdm=False))
        pids = [p.pid for p in tp.parallel.processes]
    assert got[0] == want[0]
    worst = max(abs(a - b) for g, w in zip(got[1], want[1]) for a, b in zip(g, w))
    print(f"largest logprob difference, TP=3 vs one process on the same GEMM: {worst:.2e}")
    # the all-reduce's order through 30 layers and 8 tokens; an order of magnitude of margin. Should it
    # fail, the message names the process-wide state an earlier test could have changed
    state = (f"threads {torch.get_num_threads()}, float32 matmul precision {torch.get_float32_matmul_precision()!r}, "
             f"oneDNN fp32 precision {torch.backends.mkldnn.matmul.fp32_precision!r}")
    assert worst < 1e-4, state
    assert _wait_gone(pids, 1.0) == []
