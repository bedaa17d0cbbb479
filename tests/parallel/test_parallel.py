"""Tensor and pipeline parallelism on a tiny model (gloo, 3 processes): each split layer against
the unsplit one, the plain forward, the KV-cached path, the pipeline, and the bytes counted.

One launch of 3 ranks runs every check (starting processes is the slow part on a CPU) and hands
back per-rank numbers; each test below asserts one of them, so each names what it proves.
The engine (LLM(..., tensor_parallel_size=3)) and process clean-up are in test_parallel_llm.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minillm.course.calculators import bubble_fraction
from minillm.model.llama import random_model, tiny_config
from minillm.parallel.launch import launch
from minillm.parallel.pipeline import check_pp_size, stage_bounds
from minillm.parallel.tensor import RowParallelLinear, allowed_tp_sizes, check_tp_size, shard_model

# 3 KV heads so that 3 ranks get one each; a vocabulary of 250 is not a multiple of 3 (padding)
CFG = tiny_config(n_heads=6, n_kv_heads=3, vocab_size=250, n_layers=3)
WORLD = 3


def _max_err(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


@torch.no_grad()
def _rank_checks(rank: int, size: int, cfg) -> dict:
    """Everything compared on one rank; returns numbers only (the test process asserts)."""
    from minillm.stages.kv_cache import KVCache, forward_cached, generate_greedy, generate_greedy_naive
    from minillm.parallel import comm
    from minillm.parallel.pipeline import pipeline_forward, stage_model
    from minillm.model.positions import rope_cos_sin

    full = random_model(cfg, seed=1)
    shard = shard_model(full, rank, size)
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (2, 11), generator=gen)                  # (B, T) held out
    x = torch.randn(2, 11, cfg.dim, generator=gen)                                     # (B, T, dim)
    out = {}
    # column-parallel: this rank's output features, no communication
    q_rows = cfg.n_heads // size * cfg.head_dim
    out["column"] = _max_err(shard.layers[0].attn.wq(x), full.layers[0].attn.wq(x)[..., rank * q_rows:(rank + 1) * q_rows])
    ffn = cfg.ffn_dim // size
    out["column_up"] = _max_err(shard.layers[0].ffn.w_up(x), full.layers[0].ffn.w_up(x)[..., rank * ffn:(rank + 1) * ffn])
    # row-parallel: this rank's input features, all-reduced to the full product
    a = torch.randn(2, 11, cfg.ffn_dim, generator=gen)                                 # (B, T, ffn)
    comm.reset_counts()
    out["row"] = _max_err(shard.layers[0].ffn.w_down(a[..., rank * ffn:(rank + 1) * ffn]), full.layers[0].ffn.w_down(a))
    out["row_calls"] = comm.COUNTS["all_reduce.calls"]
    biased = torch.nn.Linear(cfg.ffn_dim, cfg.dim, bias=True)
    torch.nn.init.normal_(biased.bias, generator=torch.Generator().manual_seed(4))          # same on every rank
    torch.nn.init.normal_(biased.weight, std=0.1, generator=torch.Generator().manual_seed(5))
    out["row_bias"] = _max_err(RowParallelLinear(biased, rank, size)(a[..., rank * ffn:(rank + 1) * ffn]), biased(a))
    out["embedding"] = _max_err(shard.embed(tokens), full.embed(tokens))
    out["lm_head"] = _max_err(shard.lm_head(x), F.linear(x, full.embed.weight))
    out["lm_head_shape"] = tuple(shard.lm_head(x).shape)
    # one block: heads split (attention) + two row-parallel all-reduces
    cos, sin = rope_cos_sin(torch.arange(11), cfg.head_dim, cfg.rope_theta)
    out["block"] = _max_err(shard.layers[0](x, cos, sin), full.layers[0](x, cos, sin))
    # the plain model: logits and the bytes communicated
    comm.reset_counts()
    logits = shard(tokens)
    out["forward"] = _max_err(logits, full(tokens))
    out["forward_counts"] = dict(comm.COUNTS)
    out["naive_tokens"] = [generate_greedy_naive(shard, p, 6) for p in ([5, 9, 2], [7] * 13)]
    # the KV-cached path: each rank's cache holds its own KV heads only
    cache = KVCache(shard.cfg, 2, 32)
    out["cache_kv_heads"] = cache.k.shape[2]
    ref_cache = KVCache(full.cfg, 2, 32)
    out["cached"] = _max_err(forward_cached(shard, tokens, cache, all_logits=True),
                             forward_cached(full, tokens, ref_cache, all_logits=True))
    step = tokens[:, :1]
    out["cached_decode"] = _max_err(forward_cached(shard, step, cache), forward_cached(full, step, ref_cache))
    prompts = [[5, 9, 2], [7] * 13, list(range(3, 30))]
    out["cached_tokens"] = generate_greedy(shard, prompts, 8)
    out["reference_tokens"] = generate_greedy(full, prompts, 8)
    out["reference_naive"] = [generate_greedy_naive(full, p, 6) for p in ([5, 9, 2], [7] * 13)]
    # pipeline: 3 stages, 4 micro-batches of a batch of 8
    batch = torch.randint(0, cfg.vocab_size, (8, 7), generator=gen)                    # (B, T)
    comm.reset_counts()
    timing = {}
    piped = pipeline_forward(stage_model(full, rank, size), batch, 4, timing)
    out["pipeline"] = None if piped is None else _max_err(piped, full(batch))
    out["pipeline_counts"] = dict(comm.COUNTS)
    out["pipeline_layers"] = len(stage_model(full, rank, size).layers)
    return out


@pytest.fixture(scope="module")
def ranks():
    return launch(_rank_checks, WORLD, CFG)


def test_column_parallel_linear_equals_its_slice_of_the_unsplit_layer(ranks):
    for r in ranks:
        assert r["column"] < 1e-5 and r["column_up"] < 1e-5


def test_row_parallel_linear_equals_the_unsplit_layer_with_one_all_reduce(ranks):
    for r in ranks:
        assert r["row"] < 1e-5
        assert r["row_calls"] == 1
        assert r["row_bias"] < 1e-5                           # the bias is added once, not once per rank


def test_vocab_parallel_embedding_and_lm_head_equal_the_unsplit_ones(ranks):
    for r in ranks:
        assert r["embedding"] == 0.0                      # one nonzero term per row: exact
        assert r["lm_head"] < 1e-5
        assert r["lm_head_shape"] == (2, 11, CFG.vocab_size)    # the padding is cut off


def test_block_with_heads_split_equals_the_unsplit_block(ranks):
    for r in ranks:
        assert r["block"] < 1e-5


def test_plain_forward_logits_and_greedy_tokens_equal_one_process(ranks):
    for r in ranks:
        assert r["forward"] < 1e-5
        assert r["naive_tokens"] == r["reference_naive"]


def test_kv_cached_path_equals_one_process_and_caches_only_own_kv_heads(ranks):
    for r in ranks:
        assert r["cache_kv_heads"] == CFG.n_kv_heads // WORLD
        assert r["cached"] < 1e-5 and r["cached_decode"] < 1e-5
        assert r["cached_tokens"] == r["reference_tokens"]


def test_tp_bytes_counted_match_two_all_reduces_per_layer_per_token(ranks):
    tokens, fp32 = 2 * 11, 4
    for r in ranks:
        counts = r["forward_counts"]
        # 2 per layer (o_proj, down) + 1 for the embedding, each of (tokens, dim)
        assert counts["all_reduce.calls"] == 2 * CFG.n_layers + 1
        assert counts["all_reduce.bytes"] == (2 * CFG.n_layers + 1) * tokens * CFG.dim * fp32
        padded = -(-CFG.vocab_size // WORLD)                   # each rank's vocabulary slice
        assert counts["all_gather.bytes"] == tokens * padded * fp32


def test_pipeline_forward_equals_one_process_and_sends_one_activation_per_boundary(ranks):
    assert ranks[0]["pipeline"] < 1e-5
    assert [r["pipeline_layers"] for r in ranks] == [1, 1, 1]
    batch_tokens = 8 * 7
    for rank, r in enumerate(ranks[:-1]):                    # stage boundary rank -> rank + 1
        assert r["pipeline_counts"]["send.bytes"] == batch_tokens * CFG.dim * 4
        assert r["pipeline_counts"]["send.calls"] == 4         # one per micro-batch
    assert ranks[-1]["pipeline_counts"]["send.bytes"] == batch_tokens * CFG.vocab_size * 4   # logits to rank 0


def test_sizes_that_do_not_split_the_kv_heads_are_refused_naming_the_ones_that_work():
    assert allowed_tp_sizes(CFG) == [1, 3]
    with pytest.raises(ValueError, match=r"tensor_parallel_size = 2 .*3 KV heads.*allowed: 1, 3"):
        check_tp_size(CFG, 2)
    with pytest.raises(ValueError, match="allowed: 1, 3"):
        shard_model(random_model(CFG), 0, 2)
    with pytest.raises(ValueError, match="pipeline_parallel_size = 4 .*3 layers"):
        check_pp_size(CFG.n_layers, 4)


def test_stage_bounds_are_contiguous_and_balanced():
    assert stage_bounds(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert stage_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_bubble_fraction_formula():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 1) == 3 / 4                     # one micro-batch: one stage busy at a time
    assert bubble_fraction(4, 12) == 3 / 15
