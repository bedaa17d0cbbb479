"""The roofline arithmetic behind lesson 01 and the lessons' practice problems: published model shapes,
ridge points, decode and prefill floors, and when decode turns compute-bound."""
import math

import pytest

from minillm.model.llama import ModelConfig
from minillm.model.shapes import SMOLLM2_135M
from minillm.perf.roofline import (GPUS, LLAMA2_7B, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B, LLAMA31_70B, compute_bound_batch,
                                   decode_bytes_per_step, decode_flops_per_token, decode_step_seconds, kv_bytes_per_token,
                                   max_sequences, prefill_flops, prefill_seconds, ridge_point, weight_bytes,
                                   weight_bytes_read)


@pytest.mark.parametrize("cfg, billions",
                         [(LLAMA2_7B, 6.74), (LLAMA2_70B, 68.98), (LLAMA3_8B, 8.03), (LLAMA3_70B, 70.55)])
def test_published_shapes_give_the_published_parameter_counts(cfg, billions):
    assert cfg.num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)


def test_llama31_70b_is_llama3_70b_with_a_128k_context():
    assert LLAMA31_70B.max_seq_len == 131072 and LLAMA31_70B.num_parameters() == LLAMA3_70B.num_parameters()
    assert kv_bytes_per_token(LLAMA31_70B, 2) == 320 * 1024


def test_gpus_are_the_datasheets_dense_bf16_flops_and_hbm_bandwidth():
    assert {name: (g["flops"] / 1e12, g["bandwidth"] / 1e9) for name, g in GPUS.items()} == {
        "A100 80GB": (312, 2039), "H100 SXM": (989, 3350), "H200": (989, 4800)}
    assert GPUS["H100 SXM"]["bandwidth"] / GPUS["A100 80GB"]["bandwidth"] == pytest.approx(1.643, abs=1e-3)


def test_ridge_point_is_flops_over_bandwidth():
    assert ridge_point("A100 80GB") == pytest.approx(312 / 2.039)
    assert ridge_point("H100 SXM") == GPUS["H100 SXM"]["flops"] / GPUS["H100 SXM"]["bandwidth"]


def intensity(cfg, batch, context):
    return batch * decode_flops_per_token(cfg, context) / decode_bytes_per_step(cfg, 2, context, batch)


@pytest.mark.parametrize("context", [0, 128, 512, 1024])
def test_compute_bound_batch_is_the_first_batch_at_the_ridge(context):
    batch = compute_bound_batch(LLAMA3_70B, "H100 SXM", 2, context)
    ridge = ridge_point("H100 SXM")
    assert intensity(LLAMA3_70B, batch, context) >= ridge > intensity(LLAMA3_70B, batch - 1, context)


def test_long_context_decode_never_turns_compute_bound():
    assert compute_bound_batch(LLAMA3_70B, "H100 SXM", 2, 4096) == math.inf
    assert intensity(LLAMA3_70B, 10**6, 4096) < ridge_point("H100 SXM")


# A model small enough to count by hand: vocab 10, dim 4, one layer, 2 query heads of 2, 1 KV head, FFN 8.
#   layer: q 4x4 + k 4x2 + v 4x2 + o 4x4 = 48, SwiGLU 3 x 4x8 = 96, two norm gains 2 x 4 = 8 -> 152
#   final norm 4; embedding 10x4 = 40; untied LM head another 40. KV per token: 2 x 1 x 1 x 2 x 2 B = 8 B.
HAND = dict(vocab_size=10, dim=4, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=2, ffn_dim=8, rope_theta=10000.0,
            max_seq_len=16)


@pytest.mark.parametrize("tied", [False, True])
def test_counts_by_hand_embedding_lookup_is_free_and_reads_its_rows_only(tied):
    cfg = ModelConfig(**HAND, tie_embeddings=tied)
    assert cfg.num_parameters() == 40 + 152 + 4 + (0 if tied else 40)
    assert kv_bytes_per_token(cfg, 2) == 8
    # decode: the layer, the final norm and the LM head multiply (2 FLOPs per weight); the lookup gathers.
    # attention: q.k and p.v, 2 FLOPs each, per head (2) per head_dim value (2) per cached key.
    for context in (0, 5):
        assert decode_flops_per_token(cfg, context) == 2 * (152 + 4 + 40) + 2 * 2 * 2 * 2 * context
    # bytes of a decode step of `batch` sequences, bf16: tied reads the shared matrix once (as the head);
    # untied reads its head and only the batch's looked-up embedding rows (4 values each).
    for batch, context in ((1, 0), (3, 5)):
        weights = 2 * (152 + 4 + 40) + (0 if tied else 2 * 4 * batch)
        assert decode_bytes_per_step(cfg, 2, context, batch) == weights + batch * context * 8
    # prefill of 7 tokens: the layer and final norm for every token, the LM head for the last one only,
    # causal attention over 1 + 2 + ... + 7 keys.
    assert prefill_flops(cfg, 7) == 2 * (152 + 4) * 7 + 2 * 40 + 2 * 2 * 2 * 2 * (7 * 8 // 2)
    assert weight_bytes_read(cfg, 2, 7) == 2 * (152 + 4 + 40) + (0 if tied else 2 * 4 * 7)
    assert weight_bytes_read(cfg, 2, 1000) == weight_bytes(cfg, 2)          # every row looked up: all of it


def test_untied_llama3_8b_decode_reads_one_embedding_row_not_the_matrix():
    embedding = LLAMA3_8B.vocab_size * LLAMA3_8B.dim * 2                   # 1.05 GB of bf16 rows
    assert decode_bytes_per_step(LLAMA3_8B, 2, 0) == weight_bytes(LLAMA3_8B, 2) - embedding + LLAMA3_8B.dim * 2
    assert decode_flops_per_token(LLAMA3_8B, 0) == 2 * (LLAMA3_8B.num_parameters() - embedding / 2)
    assert 1000 * decode_step_seconds(LLAMA3_8B, "H100 SXM", 2) == pytest.approx(4.48, abs=0.01)


def test_decode_step_is_bandwidth_bound_at_batch_1_and_compute_bound_past_the_ridge():
    gpu = GPUS["H200"]
    assert decode_step_seconds(LLAMA3_8B, "H200", 2) == decode_bytes_per_step(LLAMA3_8B, 2, 0) / gpu["bandwidth"]
    big = 4 * compute_bound_batch(LLAMA3_8B, "H200", 2)
    assert decode_step_seconds(LLAMA3_8B, "H200", 2, big) == big * decode_flops_per_token(LLAMA3_8B, 0) / gpu["flops"]


@pytest.mark.parametrize("cfg", [LLAMA2_7B, SMOLLM2_135M])                 # untied and tied
def test_prefill_flops_are_the_decode_flops_of_every_position_less_all_but_one_lm_head(cfg):
    tokens = 37
    head = 2 * cfg.vocab_size * cfg.dim
    assert prefill_flops(cfg, tokens) == sum(decode_flops_per_token(cfg, t + 1) for t in range(tokens)) \
        - (tokens - 1) * head
    assert prefill_seconds(LLAMA2_7B, "H100 SXM", 2, 4096) == prefill_flops(LLAMA2_7B, 4096) / GPUS["H100 SXM"]["flops"]


def test_max_sequences_fills_what_the_weights_leave():
    n = max_sequences(LLAMA2_7B, 80e9, 4096, 2)
    per_seq = 4096 * kv_bytes_per_token(LLAMA2_7B, 2)
    assert weight_bytes(LLAMA2_7B, 2) + n * per_seq <= 80e9 < weight_bytes(LLAMA2_7B, 2) + (n + 1) * per_seq
    assert max_sequences(LLAMA3_70B, 80e9, 4096, 2) == 0                # the weights alone do not fit
    assert max_sequences(LLAMA2_7B, 80e9, 4096, 2, kv_bytes_per_value=1) >= 2 * n


def test_bandwidth_probe_keeps_every_sample_and_bounds_by_the_fastest(monkeypatch):
    """A VM's bandwidth moves between runs: the probe keeps each sample in order, and the bound
    uses the fastest; asking for the bound before any sample is an error, not a silent 0."""
    import minillm.perf.roofline as roofline

    probe = roofline.BandwidthProbe(mbytes=4)
    assert probe.nbytes == 4 * 2**20 and probe.weight.shape == (4 * 2**20 // (4 * 4096), 4096)
    with pytest.raises(RuntimeError, match="sample"):
        probe.best
    seconds = iter([0.004, 0.002, 0.001, 0.003, 0.002, 0.004])       # (GEMV, read) per sample
    monkeypatch.setattr(roofline, "time_median", lambda fn, repeats, device=None: next(seconds))
    first, second, third = probe.sample(), probe.sample(), probe.sample()
    assert probe.samples == [first, second, third]
    assert first == probe.nbytes / 0.002 and second == probe.nbytes / 0.001 and third == probe.nbytes / 0.002
    assert probe.best == second


def test_gemm_probe_keeps_each_routes_fastest_sample(monkeypatch):
    import minillm.perf.roofline as roofline

    probe = roofline.GemmProbe(n=64)
    with pytest.raises(RuntimeError, match="sample"):
        probe.best
    rates = iter([{"torch a @ b": 1.0, "onednn": 5.0}, {"torch a @ b": 3.0, "onednn": 4.0}])
    monkeypatch.setattr(roofline, "measure_gemm_rates", lambda n, dtype, repeats: next(rates))
    probe.sample(), probe.sample()
    assert len(probe.samples) == 2
    assert probe.best == {"torch a @ b": 3.0, "onednn": 5.0}             # per route, from different samples


def test_bandwidth_over_time_records_both_thread_counts_and_restores_the_threads():
    import torch
    from minillm.course.benchmarks.roofline import bandwidth_over_time

    threads = torch.get_num_threads()
    out = bandwidth_over_time(2, seconds_apart=0, mbytes=4)
    assert len(out[f"threads_{threads}"]) == 2 and len(out["threads_1"]) == 2
    assert out["lowest_GBps"] == min(out[f"threads_{threads}"]) > 0
    assert out["highest_GBps"] == max(out[f"threads_{threads}"])
    assert torch.get_num_threads() == threads


def test_gemm_rates_time_torch_and_every_prepacking_library(monkeypatch):
    import torch
    from minillm.model import prepacked
    from minillm.perf import roofline

    monkeypatch.setattr(roofline, "measure_flops", lambda n, dtype, repeats: 5.0)     # torch's a @ b: 5 FLOP/s
    monkeypatch.setattr(roofline, "time_median", lambda fn, repeats: 2 * 8 ** 3 / 7.0)   # prepacked: 7 FLOP/s
    libraries = prepacked.libraries_for(torch.randn(8, 8))
    rates = roofline.measure_gemm_rates(8, torch.float32)
    assert rates == {"torch a @ b": 5.0, **{library: pytest.approx(7.0) for library in libraries}}


def test_speculative_crossover_with_the_kv_cache_against_a_hand_count():
    """Lesson 08 §4: the speculative step does (1 + k) x the FLOPs and reads the same bytes (weights once,
    each request's KV once), so the crossover B = E W R / ((1 + k) F - E R m) moves out with the context."""
    from minillm.perf.roofline import (expected_tokens_per_call, speculation_always_pays_context,
                                       speculative_crossover_batch, speculative_roofline_speedup)
    from minillm.course.calculators import crossover_batch

    e = (1 - 0.8 ** 5) / 0.2                                                  # 3.36 tokens per verification
    assert expected_tokens_per_call(0.8, 4) == pytest.approx(e) and expected_tokens_per_call(1.0, 4) == 5
    # Llama-2-7B (MHA), bf16, H200, 128 cached tokens, by hand from the config: shared weights (the
    # untied input embedding only gathered), per request its KV and its embedding row, FLOPs per token.
    c, ridge = LLAMA2_7B, 989e12 / 4.8e12
    body = c.num_parameters() - c.vocab_size * c.dim
    weights, per_request = 2 * body, 2 * c.dim + 128 * 2 * c.n_layers * c.n_kv_heads * c.head_dim * 2
    flops = 2 * body + 4 * c.n_layers * c.n_heads * c.head_dim * 128
    hand = e * ridge * weights / (5 * flops - e * ridge * per_request)
    assert speculative_crossover_batch(c, "H200", 2, 128, 0.8, 4) == pytest.approx(hand)
    assert 400 < hand < 500                                                    # vs ~139 without the KV term
    assert speculative_roofline_speedup(c, "H200", 2, round(hand), 128, 0.8, 4) == pytest.approx(1, abs=0.01)
    # context 0: the KV-free formula of speculative_engine, N* = R W / F tokens (up to the embedding rows)
    assert speculative_crossover_batch(c, "H200", 2, 0, 0.8, 4) == pytest.approx(
        crossover_batch(0.8, 4, ridge * weights / (2 * body)), rel=1e-3)
    # long context: never crosses; speculation keeps E at any batch (MHA from ~183 tokens, GQA-8 later)
    mha, gqa = (speculation_always_pays_context(m, "H200", 2, 0.8, 4) for m in (LLAMA2_7B, LLAMA3_8B))
    assert 150 < mha < 200 < 4 * mha < gqa < 1000
    assert speculative_crossover_batch(c, "H200", 2, math.floor(mha), 0.8, 4) < math.inf
    assert speculative_crossover_batch(c, "H200", 2, math.ceil(mha), 0.8, 4) == math.inf
    assert speculative_roofline_speedup(LLAMA3_8B, "H200", 2, 256, 4096, 0.8, 4) == pytest.approx(e)


# ------------------------------------------------------------------- lesson 04: a W4A16 GEMV's instruction budget

def test_gemv_instruction_budget_is_issue_slots_per_weight_the_memory_delivers():
    from minillm.perf.roofline import (HOPPER_SXM, W4A16_G128_BITS, boost_clock_hz, gemv_bandwidth_share,
                                       gemv_instruction_budget)
    clock = boost_clock_hz()
    assert clock == pytest.approx(1.98e9, rel=1e-3)          # 66.9 TFLOPS / (2 x 16,896 FP32 cores)
    budget = gemv_instruction_budget("H200")
    weights_per_second = GPUS["H200"]["bandwidth"] / (W4A16_G128_BITS / 8)
    assert budget == pytest.approx(128 * clock * HOPPER_SXM["sms"] / weights_per_second)
    assert 3.6 < budget < 3.7                                  # lesson 04: ~3.65 on an H200
    assert gemv_instruction_budget("H100 SXM") == pytest.approx(budget * 4.8 / 3.35)   # less bandwidth, more room
    assert gemv_bandwidth_share(budget / 2) == 1.0             # a loop inside the budget reads at full speed
    assert gemv_bandwidth_share(2 * budget) == pytest.approx(0.5)
    assert gemv_bandwidth_share(5.71875) == pytest.approx(0.638, abs=1e-3)   # the compiled loop: ~64%
