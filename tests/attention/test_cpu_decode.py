"""The C decode attention kernel (attention/cpu_decode.c) against the gather-then-softmax reference and the
compiled PyTorch kernel whose contract it takes, and the engine running it (the "cpu" attention backend): the
same tokens as the "torch" backend's gather + SDPA, every decode row in one call."""
import pytest
import torch

from helpers import CharTokenizer, paged_case, random_prompts
from minillm import LLM, SamplingParams
from minillm.attention import cpu_decode
from minillm.attention.backends import choose_backend, make_backend
from minillm.attention.paged import decode_attention_fused, paged_attention_reference
from minillm.model.llama import random_model, tiny_config

pytestmark = pytest.mark.skipif(cpu_decode.kernel()[0] is None, reason=f"no C kernel here: {cpu_decode.kernel()[1]}")


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 4, 16), (6, 2, 64), (9, 3, 64), (8, 1, 128)])
@pytest.mark.parametrize("lengths, block_size", [([1], 4), ([5, 17, 3, 12], 4), ([33, 1, 70], 16), ([40, 16], 16)])
def test_the_kernel_matches_the_reference_in_fp32(num_heads, num_kv_heads, head_dim, lengths, block_size):
    q, k_cache, v_cache, tables, lens = paged_case(lengths, num_heads, num_kv_heads, head_dim, block_size)
    want = paged_attention_reference(q, k_cache, v_cache, tables, lens, head_dim ** -0.5)   # (B, Hq, D)
    got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_in_bf16_it_is_fp32_math_rounded_once():
    q, k_cache, v_cache, tables, lens = paged_case([9, 30, 2, 64], 9, 3, 64, 16, dtype=torch.bfloat16)
    exact = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens, 64 ** -0.5)
    got = cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens)
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max() <= 2 ** -8 * exact.abs().max()   # one bf16 rounding of the output


@pytest.mark.parametrize("window", [1, 5, 16, 33, 1000])
def test_a_sliding_window_is_the_compiled_kernels(window):
    q, k_cache, v_cache, tables, lens = paged_case([40, 7, 64, 17], 6, 2, 32, 8)
    torch.testing.assert_close(cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, window),
                               decode_attention_fused(q, k_cache, v_cache, tables, lens, window), atol=1e-5, rtol=1e-5)


def test_keys_past_a_sequence_and_before_its_window_are_never_read():
    q, k_cache, v_cache, tables, lens = paged_case([6, 30], 4, 2, 16, 4)
    want = cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, window=9)
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    used = set()
    for row, n in enumerate(lens.tolist()):
        for p in range(n - 9, n):                                       # the keys the row sees
            used.add((tables[row, p // 4].item(), p % 4))
    for block in range(k_cache.shape[0]):
        for slot in range(4):
            if (block, slot) not in used:
                k_poisoned[block, slot] = float("nan")
                v_poisoned[block, slot] = float("nan")
    torch.testing.assert_close(cpu_decode.decode_attention(q, k_poisoned, v_poisoned, tables, lens, window=9), want)


def test_bad_input_is_refused_by_name():
    q, k_cache, v_cache, tables, lens = paged_case([5, 9], 4, 2, 16, 4)
    with pytest.raises(ValueError, match="fp32 or bf16"):
        cpu_decode.decode_attention(q.half(), k_cache.half(), v_cache.half(), tables, lens)
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_decode.decode_attention(q[..., :8], k_cache[..., :8], v_cache[..., :8], tables, lens)
    with pytest.raises(ValueError, match="seq_len outside 1 .. 12"):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables, torch.tensor([5, 13]))
    with pytest.raises(ValueError, match="seq_len outside"):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables, torch.tensor([0, 9]))
    with pytest.raises(ValueError, match="block number outside 0 .. "):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables + 100, lens)
    with pytest.raises(ValueError, match="window"):
        cpu_decode.decode_attention(q, k_cache, v_cache, tables, lens, window=0)


def test_where_it_cannot_be_built_it_says_why_and_the_engine_keeps_the_compiled_kernel(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", "false")                                   # a compiler that always fails
    monkeypatch.setattr(cpu_decode, "library_path", lambda: tmp_path / "cpu_decode.so")
    cpu_decode.kernel.cache_clear()
    try:
        lib, why = cpu_decode.kernel()
        assert lib is None and "cc failed" in why
        llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), max_model_len=64)
        assert llm.engine.runner.attention.name == "cpu-fused" and llm.engine.decode_group_cost is not None
        with pytest.raises(ValueError, match="'cpu' attention backend's C kernel is not available"):
            make_backend("cpu", llm.engine.kv)
    finally:
        cpu_decode.kernel.cache_clear()


def test_the_engine_attends_every_decode_row_in_one_call_with_the_torch_backends_tokens(monkeypatch, fresh_compile_caches):
    cfg = tiny_config()
    llm = LLM(model=random_model(cfg, seed=0), tokenizer=CharTokenizer(), device="cpu", max_model_len=256,
              max_num_seqs=12, max_num_batched_tokens=48)                # 12 rows: more than a small step takes
    runner = llm.engine.runner
    assert choose_backend(runner.kv, False, cfg.n_heads) == runner.attention.name == "cpu"
    assert llm.engine.decode_group_cost is None                         # no groups by length
    calls = []                                                          # counted where the op calls the kernel:
    decode = cpu_decode.decode_attention                                # a decode-only step calls it inside its graph
    monkeypatch.setattr(cpu_decode, "decode_attention", lambda q, *rest: calls.append(q.shape[0]) or decode(q, *rest))
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 9, 25, 70, 1] * 2, cfg.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(calls) == 12 and len(calls) >= 10 * cfg.n_layers         # all twelve rows at once, in every layer
    assert runner.compiled_decode_only_steps > 0 and runner.compile_failed is None   # ... in the decode-only step
    runner.attention = make_backend("torch", runner.kv)                 # gather + SDPA, in groups by length
    llm.engine.decode_group_cost = 16
    runner.decode_weights = None                                        # (the compiled small step is the same in both)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    llm.close()


def test_an_unwritable_cache_or_a_missing_compiler_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setattr(cpu_decode, "library_path", lambda: blocked / "kernels" / "cpu_decode.so")
    cpu_decode.kernel.cache_clear()
    try:
        lib, why = cpu_decode.kernel()
        assert lib is None and "could not build" in why
        monkeypatch.setattr(cpu_decode, "library_path", lambda: tmp_path / "cpu_decode.so")
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        cpu_decode.kernel.cache_clear()
        lib, why = cpu_decode.kernel()
        assert lib is None and "could not build" in why
    finally:
        cpu_decode.kernel.cache_clear()
