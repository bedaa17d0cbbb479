"""MHA -> GQA/MQA conversion by mean-pooling K/V heads."""
import pytest
import torch

from minillm.attention.gqa import convert_kv_heads, mean_pool_kv_heads
from minillm.model.llama import random_model, tiny_config
from minillm.stages.kv_cache import KVCache, generate_greedy, generate_greedy_naive


def test_mean_pool_groups_consecutive_heads():
    w = torch.arange(6 * 2 * 3, dtype=torch.float32).reshape(6 * 2, 3)   # 6 heads of D=2
    pooled = mean_pool_kv_heads(w, 6, 2)                                  # groups {0,1,2}, {3,4,5}
    assert torch.equal(pooled[:2], (w[0:2] + w[2:4] + w[4:6]) / 3)
    assert torch.equal(pooled[2:], (w[6:8] + w[8:10] + w[10:12]) / 3)


def test_converting_to_the_same_heads_changes_nothing():
    model = random_model(tiny_config(), seed=4)
    same = convert_kv_heads(model, model.cfg.n_kv_heads)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids), same(ids))


def test_mqa_model_runs_cached_equal_to_its_own_baseline():
    mqa = convert_kv_heads(random_model(tiny_config(), seed=5), 1)
    assert mqa.cfg.n_kv_heads == 1 and mqa.layers[0].attn.wk.out_features == mqa.cfg.head_dim
    assert KVCache(mqa.cfg, 1, 10).k.shape[2] == 1
    prompt = [1, 2, 3, 4]
    assert generate_greedy(mqa, [prompt], 30)[0] == generate_greedy_naive(mqa, prompt, 30)


def test_bad_head_count():
    with pytest.raises(ValueError, match="must divide"):
        convert_kv_heads(random_model(tiny_config()), 4)


def test_cache_built_for_other_heads_is_refused():
    from minillm.stages.kv_cache import forward_cached

    mqa = convert_kv_heads(random_model(tiny_config(), seed=6), 1)
    with pytest.raises(ValueError, match="KV heads"):
        forward_cached(mqa, torch.zeros(1, 3, dtype=torch.long), KVCache(tiny_config(), 1, 8))


def test_llm_with_a_converted_model_uses_its_config(llm):
    """Regression: LLM allocated its cache from the config it loaded, not from the model it runs."""
    from minillm import SamplingParams

    base = llm.model
    try:
        llm.model = convert_kv_heads(base, 1)
        ids = llm.get_tokenizer().encode("The capital of France is")
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        assert out[0].outputs[0].token_ids == generate_greedy_naive(llm.model, ids, 8)
    finally:
        llm.model = base
