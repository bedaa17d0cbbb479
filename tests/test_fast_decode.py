"""The fast batch-1 path (fused projections, RoPE table, SDPA) gives the baseline's tokens."""
import pytest
import torch
import torch.nn as nn

from minillm import SamplingParams
from minillm.fast_decode import RopeTable, forward_fast, fuse_projections, generate_greedy_fast, is_fused
from minillm.kv_cache import KVCache, generate_greedy, generate_greedy_naive
from minillm.model import random_model, tiny_config


def _fast_greedy(model, prompt, n, chunks=(None,)):
    cache = KVCache(model.cfg, 1, len(prompt) + n)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, len(prompt) + n, "cpu")
    cut = chunks[0] or len(prompt)
    logits = forward_fast(model, torch.tensor([prompt[:cut]]), cache, rope)
    if cut < len(prompt):                                     # prefill in two chunks
        logits = forward_fast(model, torch.tensor([prompt[cut:]]), cache, rope)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = forward_fast(model, torch.tensor([[out[-1]]]), cache, rope)
    return out


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_tiny_fast_equals_naive(chunk):
    model = random_model(tiny_config(), seed=1)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    ref = generate_greedy_naive(model, prompt, 64)
    fuse_projections(model)
    assert is_fused(model)
    assert _fast_greedy(model, prompt, 64, (chunk,)) == ref
    assert generate_greedy_fast(model, prompt, 64) == ref


def test_fused_weights_are_views_not_copies():
    model = fuse_projections(random_model(tiny_config(), seed=2))
    attn = model.layers[0].attn
    assert attn.wq.weight.data_ptr() == attn.wqkv.weight.data_ptr()
    with torch.no_grad():
        attn.wqkv.weight[0, 0] = 123.0
    assert attn.wq.weight[0, 0] == 123.0


def test_replacing_a_projection_disables_the_fast_path():
    model = fuse_projections(random_model(tiny_config(), seed=3))
    model.layers[1].ffn.w_up = nn.Linear(96, 192, bias=False)
    assert not is_fused(model)


def test_real_model_llm_generate_equals_cached_baseline(llm):
    assert is_fused(llm.model)
    prompt = llm.get_tokenizer().encode("Three facts about the planet Mars:")
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == generate_greedy(llm.model, [prompt], 128)[0]
