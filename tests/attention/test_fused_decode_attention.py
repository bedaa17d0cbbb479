"""The CPU engine's fused decode attention (paged_attention.decode_attention_fused, compiled by
attention.fused_decode_attention) against the gather-then-softmax reference, and the engine
really running it (the "cpu-fused" attention backend): same tokens as the "torch" backend's
gather + SDPA, with the calls counted."""
import pytest
import torch

from helpers import CharTokenizer, paged_case, random_prompts, symbols_created
from minillm import LLM, SamplingParams
from minillm.attention.backends import decode_attention_gathered, fused_decode_attention, make_backend
from minillm.attention.paged import paged_attention_reference
from minillm.model.llama import random_model, tiny_config
from minillm.model.runner import GROUP_COST_BLOCKS


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("lengths", [[1], [5, 17, 3, 12], [4, 4], [33, 1, 70]])
def test_fused_decode_attention_matches_the_reference_in_fp32(num_heads, num_kv_heads, lengths):
    # [1] and [4, 4] with block size 4: one row and one block per row, which the wrapper pads
    q, k_cache, v_cache, tables, lens = paged_case(lengths, num_heads, num_kv_heads)
    want = paged_attention_reference(q, k_cache, v_cache, tables, lens, q.shape[-1] ** -0.5)   # (B, Hq, D)
    got = fused_decode_attention(q, k_cache, v_cache, tables, lens)
    assert got.shape == want.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(decode_attention_gathered(q, k_cache, v_cache, tables, lens), want,
                               atol=1e-5, rtol=1e-5)                    # the fallback keeps the contract


def test_fused_decode_attention_in_bf16_is_fp32_math_rounded_once():
    q, k_cache, v_cache, tables, lens = paged_case([9, 30, 2], 9, 3, dtype=torch.bfloat16)
    exact = paged_attention_reference(q.float(), k_cache.float(), v_cache.float(), tables, lens,
                                      q.shape[-1] ** -0.5)             # fp32 on the same rounded inputs
    got = fused_decode_attention(q, k_cache, v_cache, tables, lens)
    assert got.dtype == torch.bfloat16
    assert (got.float() - exact).abs().max() <= 2 ** -8 * exact.abs().max()   # one bf16 rounding of the output


def test_keys_past_a_sequence_are_never_read():
    q, k_cache, v_cache, tables, lens = paged_case([6, 11], 4, 2)
    want = fused_decode_attention(q, k_cache, v_cache, tables, lens)
    k_poisoned, v_poisoned = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[1]
    for row, n in enumerate(lens.tolist()):                             # the rest of the last block, padding blocks
        for p in range(n, tables.shape[1] * block_size):
            block = tables[row, p // block_size]
            if block != 0 or p // block_size < -(-n // block_size):
                k_poisoned[block, p % block_size] = 1e4
                v_poisoned[block, p % block_size] = float("nan")
    torch.testing.assert_close(fused_decode_attention(q, k_poisoned, v_poisoned, tables, lens), want)


def tiny_llm(**kwargs):
    model = random_model(tiny_config(), seed=0)
    return LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=256, **kwargs)


def test_engine_runs_the_fused_decode_attention_and_gives_the_gather_paths_tokens():
    prompts = [{"prompt_token_ids": p} for p in random_prompts([3, 40, 9, 25, 70, 1] * 2, 200)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = tiny_llm(max_num_seqs=12)                                     # 12 rows: more than a small step takes
    runner = llm.engine.runner
    fused, compiled_weights = make_backend("cpu-fused", runner.kv), runner.decode_weights   # the C kernel's fallback
    llm.engine.decode_group_cost = GROUP_COST_BLOCKS                    # both backends take groups by length
    runner.attention = make_backend("torch", runner.kv)                 # gather + SDPA
    runner.decode_weights = None                                        # (the compiled small step reads in place too)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert fused.fused_calls == 0
    runner.attention, runner.decode_weights = fused, compiled_weights
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    # every decode step of several rows attends in every layer (groups by length may split a step)
    assert fused.fused_calls >= 10 * tiny_config().n_layers
    llm.close()


def test_an_int8_kv_cache_keeps_the_gather_path():
    llm = tiny_llm(max_num_seqs=2, kv_cache_dtype="int8")
    assert llm.engine.runner.attention.name == "torch"                 # its gather dequantises
    assert llm.engine.runner.decode_weights is None                    # no compiled step over it either
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.close()


def test_a_second_head_layout_keeps_its_head_sizes_static_and_new_row_counts_reuse_its_graph():
    """Dynamo remembers sizes per function: under its default, a second head layout would turn the head
    counts and head size symbolic (slower loops). Compiled with dynamic=False, only the sizes the wrapper
    marks (rows, blocks per row, pool blocks) are symbols, and other row and block counts reuse the graph."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    fused_decode_attention(*paged_case([5, 17, 3], 4, 2))                   # the first layout: D=16
    graphs = counters["stats"]["unique_graphs"]
    with symbols_created() as new_symbols:
        q, k_cache, v_cache, tables, lens = paged_case([9, 30], 6, 3, head_dim=8)   # the second layout
        got = fused_decode_attention(q, k_cache, v_cache, tables, lens)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    fused_decode_attention(*paged_case([2, 40, 7, 11], 6, 3, head_dim=8, seed=1))   # more rows and blocks
    assert counters["stats"]["unique_graphs"] == graphs + 1
    torch.testing.assert_close(got, paged_attention_reference(q, k_cache, v_cache, tables, lens, 8 ** -0.5),
                               atol=1e-5, rtol=1e-5)
    marked = {"L['q'].size()[0]", "L['block_tables'].size()[0]", "L['block_tables'].size()[1]",
              "L['seq_lens'].size()[0]", "L['k_cache'].size()[0]", "L['v_cache'].size()[0]"}
    sizes = [r.split(" for ", 1)[1].split(" ")[0] for r in new_symbols]
    assert sizes and set(sizes) <= marked, sizes                 # before dynamic=False: Hq, Hkv and D too
