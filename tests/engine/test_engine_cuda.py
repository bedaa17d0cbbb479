"""The engine on the Triton paged path (what a GPU runs): every request's tokens equal running it alone.

tests/engine/test_engine.py proves the engine's behaviours on the CPU path (decode groups + SDPA). Here
the same behaviours run where decode rows go through kernels/paged_attention.py (store_kv and
paged_attention_decode, one launch for every row, no decode groups) and decode-only steps through
the padded static-buffer forward of CUDA graphs (minillm/model/cuda_graphs.py):
- "cpu-interpreter": the Triton path forced on CPU (ModelRunner(triton_on_cpu=True)) under
  TRITON_INTERPRET=1, tiny model; graphs run unrecorded;
- "cuda": the compiled kernels and recorded graphs (skipped without CUDA), plus the real model.
The reference is minillm.stages.reference.stream_contiguous, each request alone on the contiguous cache, fp32: identical
greedy tokens. count_calls proves the Triton kernels ran rather than a fallback.
"""
import functools

import pytest
import torch

import kernels.paged_attention as paged_kernels
from helpers import CharTokenizer, alone, count_calls, random_prompts
from minillm import LLM, SamplingParams
from minillm.engine.engine import Engine
from minillm.kernel_support.args import INTERPRETED
from minillm.model.llama import random_model, tiny_config

DEVICES = [
    pytest.param("cpu-interpreter", marks=pytest.mark.skipif(not INTERPRETED, reason="needs TRITON_INTERPRET=1")),
    pytest.param("cuda", marks=[pytest.mark.cuda,
                                pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]),
]
LENGTHS = [1, 5, 17, 33, 64, 3, 40]
MAX_TOKENS = [5, 12, 1, 10, 8, 14, 6]


def tiny_llm(device, **kwargs):
    """A tiny random model on the Triton paged path of `device` ("cpu" for the contiguous reference)."""
    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(),
              device="cuda" if device == "cuda" else "cpu", max_model_len=kwargs.pop("max_model_len", 256), **kwargs)
    if device == "cpu-interpreter":       # the engine the LLM would build, on the Triton path on CPU
        llm._engine = Engine(llm, triton_on_cpu=True)
    return llm


def workload(vocab, lengths=LENGTHS, max_tokens=MAX_TOKENS, seed=0):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(lengths, vocab, seed)]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]


@functools.cache
def reference(device, seed=0, n=None):
    """Tokens of the default workload (or n random requests) alone on the contiguous cache of the device."""
    llm = tiny_llm("cuda" if device == "cuda" else "cpu")
    return alone(llm, *(many(llm.config.vocab_size, n) if n else workload(llm.config.vocab_size, seed=seed)))


def many(vocab, n):
    gen = torch.Generator().manual_seed(n)
    lengths = torch.randint(1, 30, (n,), generator=gen).tolist()
    return workload(vocab, lengths, torch.randint(1, 8, (n,), generator=gen).tolist(), seed=n)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def kernel_calls(monkeypatch) -> tuple[list, list]:
    """Record calls of the paged decode kernel and of the Triton K/V store."""
    return (count_calls(monkeypatch, "paged_attention_decode", paged_kernels),
            count_calls(monkeypatch, "store_kv", paged_kernels))


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_prefill_and_decode_steps(device, monkeypatch):
    llm = tiny_llm(device, max_num_batched_tokens=64)
    assert llm.engine.runner.use_triton and llm.engine.decode_group_cost is None
    decode, store = kernel_calls(monkeypatch)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference(device)
    log = llm.engine.step_log
    assert max(s["num_seqs"] for s in log) > 1
    assert any(s["num_decodes"] and s["num_tokens"] > s["num_decodes"] for s in log)   # mixed steps
    assert decode and store                                              # the Triton kernels ran
    assert llm.engine.runner.graphs.padded_steps > 0                     # and decode-only steps were padded


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [7, 4096])
def test_chunked_prefill(device, chunk):
    llm = tiny_llm(device, max_num_batched_tokens=chunk)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference(device)
    assert max(s["num_tokens"] for s in llm.engine.step_log) <= chunk


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_caching_hits(device, monkeypatch):
    llm = tiny_llm(device, enable_prefix_caching=True, max_num_seqs=2)
    shared = random_prompts([48], llm.config.vocab_size, seed=5)[0]
    prompts = [{"prompt_token_ids": shared + tail} for tail in random_prompts([3, 9, 20], llm.config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = llm.make_requests(prompts, params)
    decode, _ = kernel_calls(monkeypatch)
    llm.engine.run(reqs[:1])                                             # fills the cache with the shared blocks
    llm.engine.run(reqs[1:])
    assert [r.num_cached_tokens for r in reqs] == [0, 48, 48]
    assert [r.output_token_ids for r in reqs] == alone(tiny_llm("cuda" if device == "cuda" else "cpu"),
                                                        prompts, [params] * 3)
    assert decode


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_with_a_small_kv_pool(device):
    # 128 KV slots; the longest request needs 72, all seven together 232 (whole blocks of 4)
    llm = tiny_llm(device, max_model_len=128, block_size=4, num_kv_blocks=32, max_num_batched_tokens=64)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference(device)
    assert sum(s["num_preempted"] for s in llm.engine.step_log) > 0
    assert llm.engine.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("device", DEVICES)
def test_many_requests(device, monkeypatch):
    llm = tiny_llm(device, max_num_seqs=10, block_size=8)
    decode, _ = kernel_calls(monkeypatch)
    prompts, params = many(llm.config.vocab_size, 24)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference(device, n=24)
    assert max(s["num_seqs"] for s in llm.engine.step_log) == 10
    assert decode


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_real_model_on_cuda_equals_alone(smollm2_path, monkeypatch):
    llm = LLM(model=str(smollm2_path), dtype="float32", device="cuda", max_model_len=512)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
               "The three primary colours are", "Water boils at"]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (24, 40, 8, 16, 30)]
    decode, store = kernel_calls(monkeypatch)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == alone(llm, prompts, params)
    assert decode and store and llm.engine.runner.graph_replays > 0
