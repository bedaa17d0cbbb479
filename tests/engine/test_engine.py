"""The continuous batching engine: every request's tokens equal running it alone.

The reference is minillm.stages.reference.stream_contiguous: one request at a time on the contiguous KV
cache (kv_cache.forward_cached, itself proven equal to the naive baseline in test_kv_cache.py).
"""
import itertools
import random

import pytest
import torch

from helpers import CharTokenizer, alone, greedy_under_naive_forward, random_prompts
from minillm import LLM, SamplingParams
from minillm.model.llama import random_model, tiny_config
from minillm.model.runner import group_by_length
from minillm.stages.reference import stream_contiguous

LENGTHS = [1, 5, 17, 33, 64, 100, 3, 40]
MAX_TOKENS = [5, 20, 1, 33, 12, 8, 40, 16]


def tiny_llm(max_model_len=256, **kwargs):
    model = random_model(tiny_config(), seed=0)
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=max_model_len, **kwargs)


def workload(vocab, temperature=0.0, seed=None):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(LENGTHS, vocab)]
    params = [SamplingParams(temperature=temperature, max_tokens=m, ignore_eos=True, seed=seed)
              for m in MAX_TOKENS]
    return prompts, params


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def reference():
    llm = tiny_llm()
    prompts, params = workload(llm.config.vocab_size)
    return alone(llm, prompts, params)


def test_mixed_batch_equals_one_at_a_time(reference):
    llm = tiny_llm(max_num_batched_tokens=64)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    log = llm.engine.step_log
    assert max(s["num_seqs"] for s in log) > 1                     # it really batched
    assert any(s["num_decodes"] and s["num_tokens"] > s["num_decodes"] for s in log)   # mixed steps


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunk_sizes_give_identical_outputs(reference, chunk):
    llm = tiny_llm(max_num_batched_tokens=chunk)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert max(s["num_tokens"] for s in llm.engine.step_log) <= chunk


@pytest.mark.parametrize("group_cost", [0, 10**9])
def test_decode_groups_give_identical_outputs(reference, group_cost):
    """CPU decode attention in groups of similar length (cost 0: a group per distinct length)
    or all rows padded together (a huge cost): same tokens."""
    llm = tiny_llm(block_size=4)
    llm.engine.decode_group_cost = group_cost
    prompts, params = workload(llm.config.vocab_size)
    groups = []
    run_forward = llm.engine.runner.forward
    llm.engine.runner.forward = lambda batch: groups.append(len(batch.decode_groups)) or run_forward(batch)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert (max(groups) == 1) if group_cost else (max(groups) >= 4)   # several lengths decode at once


def test_group_by_length_is_the_cheapest_split():
    rng = random.Random(0)
    for _ in range(200):
        blocks = [rng.randint(1, 40) for _ in range(rng.randint(1, 7))]
        cost = rng.choice([0, 3, 16])
        groups = group_by_length(blocks, cost)
        assert sorted(i for g in groups for i in g) == list(range(len(blocks)))
        price = lambda gs: sum(cost + len(g) * max(blocks[i] for i in g) for g in gs)
        order = sorted(range(len(blocks)), key=blocks.__getitem__)
        cheapest = min(price([order[a:b] for a, b in zip((0, *cuts), (*cuts, len(order)))])
                       for k in range(len(blocks)) for cuts in itertools.combinations(range(1, len(order)), k))
        assert price(groups) == cheapest
    assert group_by_length([5, 1, 3], 100) == [[0, 1, 2]]         # one group keeps the batch order


def test_static_prefill_without_chunking(reference):
    llm = tiny_llm(enable_chunked_prefill=False, max_num_batched_tokens=256)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference


def test_tiny_kv_budget_forces_preemption_and_outputs_stay_equal(reference):
    # 128 KV slots; the longest request needs 108, all eight together 398
    llm = tiny_llm(max_model_len=128, block_size=4, num_kv_blocks=32, max_num_batched_tokens=64)
    prompts, params = workload(llm.config.vocab_size)
    assert tokens(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert sum(s["num_preempted"] for s in llm.engine.step_log) > 0
    assert llm.engine.block_manager.num_free_blocks == 32


def test_prefix_caching_keeps_outputs_and_skips_shared_blocks():
    llm = tiny_llm(enable_prefix_caching=True, max_num_seqs=1)
    shared = random_prompts([48], llm.config.vocab_size, seed=5)[0]
    prompts = [{"prompt_token_ids": shared + tail} for tail in random_prompts([3, 9, 20], llm.config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    reqs = llm.make_requests(prompts, params)
    llm.engine.run(reqs)
    assert [r.num_cached_tokens for r in reqs] == [0, 48, 48]
    assert [r.output_token_ids for r in reqs] == alone(llm, prompts, [params] * 3)


def test_seeded_sampling_does_not_depend_on_the_batch():
    llm = tiny_llm()
    prompts, _ = workload(llm.config.vocab_size)
    mine = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=1234, ignore_eos=True)
    solo = llm.generate([prompts[3]], mine, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=30, seed=i, ignore_eos=True) for i in range(len(prompts))]
    others[3] = mine
    crowd = llm.generate(prompts, others, use_tqdm=False)[3].outputs[0].token_ids
    assert solo == crowd
    assert solo == llm.generate([prompts[3]], mine, use_tqdm=False)[0].outputs[0].token_ids


def test_abort_frees_all_blocks():
    llm = tiny_llm(block_size=4)
    engine = llm.engine
    prompts, params = workload(llm.config.vocab_size)
    reqs = llm.make_requests(prompts, params)
    for r in reqs:
        engine.add_request(r)
    for _ in range(3):
        engine.step()
    victim = next(r for r in reqs if not r.finished and r.status.value == "running")
    held = len(engine.block_manager.block_table(victim.request_id))
    free_before = engine.block_manager.num_free_blocks
    engine.abort_request(victim.request_id)
    assert victim.finish_reason == "abort" and victim.request_id not in engine.block_manager.request_ids
    assert engine.block_manager.num_free_blocks == free_before + held
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stream_stopped_early_frees_its_blocks():
    llm = tiny_llm()
    stream = llm.stream({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(stream)
    stream.close()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_prompt_logprobs_through_the_engine_equal_the_single_path():
    llm = tiny_llm(max_num_batched_tokens=16)                 # the prompt arrives in chunks
    prompt = {"prompt_token_ids": random_prompts([40], llm.config.vocab_size)[0]}
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0, logprobs=1)
    (got,) = llm.make_requests([prompt], params)
    llm.engine.run([got])
    got = llm.output_processor.to_output(got)
    (req,) = llm.make_requests([prompt], params)
    for _ in stream_contiguous(llm, req):
        pass
    assert got.outputs[0].token_ids == req.output_token_ids
    assert len(got.prompt_logprobs) == 40 and got.prompt_logprobs[0] is None
    for a, b in zip(got.prompt_logprobs[1:], req.prompt_logprobs[1:]):
        ((ta, la),) = a.items()
        ((tb, lb),) = b.items()
        assert ta == tb and la.logprob == pytest.approx(lb.logprob, abs=1e-4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_kv_blocks=3), "num_kv_blocks"), (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_batched_tokens=-1), "max_num_batched_tokens"),
])
def test_bad_engine_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tiny_llm(**kwargs)


# --- the real model ----------------------------------------------------------------------------

def test_smollm2_batched_engine_equals_naive_greedy(llm, smollm2_path):
    """The model on the paged cache, four requests sharing every step, chunked prefill: every greedy
    token (up to 128 per request) is the naive forward's choice given the tokens before it, to within
    a near-tie (teacher-forced: one naive forward per request)."""
    tok = llm.get_tokenizer()
    texts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
             "List three prime numbers and explain why each is prime."]
    prompts = [{"prompt_token_ids": tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]))}
               for t in texts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (128, 48, 64, 32)]
    engine_llm = LLM(model=str(smollm2_path), dtype="float32", device="cpu", max_num_batched_tokens=24)
    assert engine_llm.engine.runner.packed_layers is not None or not torch._C.has_mkl   # the prepacked GEMMs
    got = tokens(engine_llm.generate(prompts, params, use_tqdm=False))
    assert [len(g) for g in got] == [128, 48, 64, 32]
    for p, g in zip(prompts, got):
        assert greedy_under_naive_forward(llm.model, p["prompt_token_ids"], g)
    assert max(s["num_seqs"] for s in engine_llm.engine.step_log) == 4


def test_int8_kv_cache_halves_memory_and_stays_close():
    """kv_cache_dtype="int8": (D + 2) bytes per token and head instead of 2D in fp16."""
    fp32 = tiny_llm(num_kv_blocks=64)
    int8 = tiny_llm(num_kv_blocks=64, kv_cache_dtype="int8")
    D = fp32.config.head_dim
    assert int8.engine.kv.nbytes / (fp32.engine.kv.nbytes / 2) == pytest.approx((D + 2) / (2 * D))
    prompts, params = workload(fp32.config.vocab_size)
    a = fp32.generate(prompts, params, use_tqdm=False)
    b = int8.generate(prompts, params, use_tqdm=False)
    same = sum(x == y for oa, ob in zip(a, b) for x, y in zip(oa.outputs[0].token_ids, ob.outputs[0].token_ids))
    assert same / sum(len(o.outputs[0].token_ids) for o in a) > 0.8
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        tiny_llm(kv_cache_dtype="fp4")


def test_fp8_kv_cache_is_stored_as_e4m3_bits_with_int8s_bytes():
    """kv_cache_dtype="fp8": e4m3 values (as uint8 bits) plus the same per-token scale as int8; what the
    engine stores decodes to valid e4m3 numbers. (Token agreement on the tiny random model is no
    test here: its near-uniform logits flip under fp8's 3-bit mantissa; the real-model perplexity
    test below is the quality check.)"""
    fp8 = tiny_llm(num_kv_blocks=64, kv_cache_dtype="fp8")
    int8 = tiny_llm(num_kv_blocks=64, kv_cache_dtype="int8")
    assert fp8.engine.kv.k.dtype == torch.uint8 and fp8.engine.kv.nbytes == int8.engine.kv.nbytes
    prompts, params = workload(fp8.config.vocab_size)
    outs = fp8.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == MAX_TOKENS
    written = fp8.engine.kv.k.view(torch.float8_e4m3fn).float()
    assert written.abs().amax() == 448 and torch.isfinite(written).all()   # each row's max maps to e4m3's max


def test_smollm2_int8_kv_cache_perplexity(smollm2_path):
    """SmolLM2 with an int8 or fp8 KV cache: perplexity on the evaluation text within 1% of fp32 KV."""
    from minillm.evaluate import perplexity

    base = LLM(model=str(smollm2_path), dtype="float32", device="cpu")
    int8 = LLM(model=base.model, tokenizer=base.get_tokenizer(), device="cpu", kv_cache_dtype="int8")
    ppl_base = perplexity(base, window=256, max_windows=2)
    ppl_int8 = perplexity(int8, window=256, max_windows=2)
    assert abs(ppl_int8 / ppl_base - 1) < 0.01, (ppl_base, ppl_int8)
    fp8 = LLM(model=base.model, tokenizer=base.get_tokenizer(), device="cpu", kv_cache_dtype="fp8")
    ppl_fp8 = perplexity(fp8, window=256, max_windows=2)
    assert abs(ppl_fp8 / ppl_base - 1) < 0.01, (ppl_base, ppl_fp8)
