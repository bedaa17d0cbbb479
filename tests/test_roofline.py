"""The roofline arithmetic behind lesson 01 and the lessons' practice problems: published model shapes,
ridge points, decode and prefill floors, and when decode turns compute-bound."""
import math

import pytest

from minillm.roofline import (GPUS, LLAMA2_7B, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B, LLAMA31_70B, compute_bound_batch,
                              decode_bytes_per_step, decode_flops_per_token, decode_step_seconds, kv_bytes_per_token,
                              max_sequences, prefill_flops, prefill_seconds, ridge_point, weight_bytes)


@pytest.mark.parametrize("cfg, billions",
                         [(LLAMA2_7B, 6.74), (LLAMA2_70B, 68.98), (LLAMA3_8B, 8.03), (LLAMA3_70B, 70.55)])
def test_published_shapes_give_the_published_parameter_counts(cfg, billions):
    assert cfg.num_parameters() / 1e9 == pytest.approx(billions, abs=0.01)


def test_llama31_70b_is_llama3_70b_with_a_128k_context():
    assert LLAMA31_70B.max_seq_len == 131072 and LLAMA31_70B.num_parameters() == LLAMA3_70B.num_parameters()
    assert kv_bytes_per_token(LLAMA31_70B, 2) == 320 * 1024


def test_ridge_point_is_flops_over_bandwidth():
    assert ridge_point("A100 80GB") == pytest.approx(156)
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


def test_decode_step_is_bandwidth_bound_at_batch_1_and_compute_bound_past_the_ridge():
    gpu = GPUS["H200"]
    assert decode_step_seconds(LLAMA3_8B, "H200", 2) == weight_bytes(LLAMA3_8B, 2) / gpu["bandwidth"]
    big = 4 * compute_bound_batch(LLAMA3_8B, "H200", 2)
    assert decode_step_seconds(LLAMA3_8B, "H200", 2, big) == big * decode_flops_per_token(LLAMA3_8B, 0) / gpu["flops"]


def test_prefill_flops_sum_the_decode_flops_of_every_position():
    tokens = 37
    assert prefill_flops(LLAMA2_7B, tokens) == sum(decode_flops_per_token(LLAMA2_7B, t + 1) for t in range(tokens))
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
    import minillm.roofline as roofline

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
    import minillm.roofline as roofline

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
    from minillm.benchmarks.roofline import bandwidth_over_time

    threads = torch.get_num_threads()
    out = bandwidth_over_time(2, seconds_apart=0, mbytes=4)
    assert len(out[f"threads_{threads}"]) == 2 and len(out["threads_1"]) == 2
    assert out["lowest_GBps"] == min(out[f"threads_{threads}"]) > 0
    assert out["highest_GBps"] == max(out[f"threads_{threads}"])
    assert torch.get_num_threads() == threads


def test_gemm_rates_time_torch_and_every_prepacking_library(monkeypatch):
    import torch
    from minillm import prepacked, roofline

    monkeypatch.setattr(roofline, "measure_flops", lambda n, dtype, repeats: 5.0)     # torch's a @ b: 5 FLOP/s
    monkeypatch.setattr(roofline, "time_median", lambda fn, repeats: 2 * 8 ** 3 / 7.0)   # prepacked: 7 FLOP/s
    libraries = prepacked.libraries_for(torch.randn(8, 8))
    rates = roofline.measure_gemm_rates(8, torch.float32)
    assert rates == {"torch a @ b": 5.0, **{library: pytest.approx(7.0) for library in libraries}}
