"""The KV cache changes speed, never tokens: identical greedy ids to the naive baseline."""
import pytest
import torch

from minillm.course.calculators import kv_cache_bytes, positions_computed, mla_kv_cache_bytes
from minillm.model.llama import random_model, tiny_config
from minillm.model.shapes import SMOLLM2_135M
from minillm.stages.kv_cache import KVCache, forward_cached, generate_greedy, generate_greedy_naive


def test_tiny_128_tokens_identical_to_naive(tiny_model):
    prompt = [3, 14, 15, 92, 65, 35]
    assert generate_greedy(tiny_model, [prompt], 128) == [generate_greedy_naive(tiny_model, prompt, 128)]


def test_tiny_batch_of_different_lengths_equals_one_at_a_time(tiny_model):
    prompts = [[7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [200, 100, 50]]
    batched = generate_greedy(tiny_model, prompts, 40)
    alone = [generate_greedy(tiny_model, [p], 40)[0] for p in prompts]
    assert batched == alone


def test_cached_logits_equal_full_forward(tiny_model):
    """Internals: prefill + decode logits at every position equal the no-cache forward."""
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    full = tiny_model(ids)                                   # (1, 20, V)
    cache = KVCache(tiny_model.cfg, 1, 20)
    pre = forward_cached(tiny_model, ids[:, :12], cache, all_logits=True)
    steps = [forward_cached(tiny_model, ids[:, t:t + 1], cache) for t in range(12, 20)]
    got = torch.cat([pre[0], torch.stack([s[0] for s in steps])])
    assert (got - full[0]).abs().max() < 1e-5
    assert cache.lengths.tolist() == [20]


def test_real_model_128_tokens_identical_to_naive(llm):
    prompt = llm.get_tokenizer().encode("The history of the printing press begins")
    cached = generate_greedy(llm.model, [prompt], 128)[0]
    # The naive baseline, teacher-forced: the forward is causal, so one no-cache forward of prompt + cached
    # gives at each position the logits generate_greedy_naive's step there computes (128 forwards -> 1).
    with torch.inference_mode():
        logits = llm.model(torch.tensor([prompt + cached]))[0, len(prompt) - 1:-1]   # (128, V)
    assert logits.argmax(-1).tolist() == cached


def test_real_model_batch_equals_one_at_a_time(llm):
    tok = llm.get_tokenizer()
    prompts = [tok.encode(t) for t in ["Hi", "Water boils at a temperature of", "def add(a, b):\n    return"]]
    assert generate_greedy(llm.model, prompts, 24) == [generate_greedy(llm.model, [p], 24)[0] for p in prompts]


def test_calculator_reproduces_the_article_llama7b_figures():
    per_token = kv_cache_bytes(n_layers=32, n_kv_heads=32, head_dim=128, seq_len=1, batch=1, dtype_bytes=2)
    assert per_token == 512 * 1024                                      # 512 KiB per token
    assert kv_cache_bytes(32, 32, 128, 1000, 1, 2) / 2**30 == pytest.approx(0.49, abs=0.01)  # ~0.5 GB
    assert kv_cache_bytes(32, 32, 128, 100_000, 1, 2) / 2**30 == pytest.approx(48.8, abs=0.1)  # ~50 GB


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_calculator_equals_allocated_bytes_for_smollm2(dtype):
    cfg = SMOLLM2_135M
    cache = KVCache(cfg, batch=2, max_len=128, dtype=dtype)
    size = torch.tensor([], dtype=dtype).element_size()
    assert cache.nbytes == kv_cache_bytes(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, 128, 2, size)


def test_overflowing_the_cache_is_a_clear_error(tiny_model):
    cache = KVCache(tiny_model.cfg, 1, 4)
    with pytest.raises(ValueError, match="KV cache holds 4 positions"):
        forward_cached(tiny_model, torch.zeros(1, 5, dtype=torch.long), cache)


def test_mla_cache_is_the_latent_plus_one_rope_key_per_layer():
    # DeepSeek-V2 (paper, Table 1): d_c = 4 d_h = 512, d_h^R = d_h / 2 = 64, 60 layers, 128 heads of 128.
    mla = mla_kv_cache_bytes(60, 512, 64, seq_len=1, batch=1, dtype_bytes=1)
    assert mla == 60 * 4.5 * 128                      # the paper's "(d_c + d_h^R) l = 9/2 d_h l" elements
    mha = kv_cache_bytes(60, 128, 128, 1, 1, 1)
    assert mha / mla == pytest.approx(2 * 128 / 4.5)   # 56.9x fewer elements than MHA
    gqa_equivalent_groups = mla / kv_cache_bytes(60, 1, 128, 1, 1, 1)
    assert gqa_equivalent_groups == 2.25              # the paper: "equal to GQA with only 2.25 groups"
    assert mla_kv_cache_bytes(61, 512, 64, 4096, 2, 2) == 61 * 576 * 4096 * 2 * 2


@pytest.mark.parametrize("prompt_len, new_tokens", [(6, 1), (6, 9), (1, 5)])
def test_positions_computed_counts_what_the_generate_loops_feed(tiny_model, prompt_len, new_tokens):
    fed = []
    hook = tiny_model.embed.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    prompt = list(range(3, 3 + prompt_len))
    generate_greedy_naive(tiny_model, prompt, new_tokens)
    naive, fed[:] = sum(fed), []
    generate_greedy(tiny_model, [prompt], new_tokens)
    hook.remove()
    assert naive == positions_computed(prompt_len, new_tokens, use_cache=False)
    assert sum(fed) == positions_computed(prompt_len, new_tokens, use_cache=True)


def test_step_timings_run_in_the_models_dtype_and_device():
    """bench kv-cache's per-step timings build their ids and cache where the model lives (notebook 02 on
    the H200 fed CPU ids to a CUDA model); a bf16 model needs a bf16 cache."""
    from minillm.stages.kv_cache import prefill_decode, step_latency
    model = random_model(tiny_config(), seed=0).to(torch.bfloat16)
    assert step_latency(model, 8, cached=True) > 0 and step_latency(model, 8, cached=False) > 0
    row = prefill_decode(model, batch=2, prompt_len=8, decode_steps=2)
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
