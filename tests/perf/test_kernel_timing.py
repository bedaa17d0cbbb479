"""The kernel timing harness: its statistics, its CPU path, its errors; on CUDA, events and graphs."""
import time

import pytest
import torch

from minillm.perf import kernel_timing

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_summary_is_per_call_median_and_spread():
    out = kernel_timing.summarize([1.0, 2.0, 3.0, 4.0, 100.0], "m", calls_per_sample=2)
    assert out["median_s"] == 1.5 and out["samples"] == 5 and out["method"] == "m"
    assert out["p10_s"] == pytest.approx(0.5 + 0.4 * 0.5)          # between the two smallest
    assert out["p90_s"] == pytest.approx(2.0 + 0.6 * 48.0)          # between the two largest


def test_cpu_timing_measures_the_call_and_says_how():
    out = kernel_timing.time_kernel(lambda: time.sleep(0.002), device="cpu", samples=5, warmup=1)
    assert 0.002 <= out["median_s"] < 0.05
    assert out["p10_s"] <= out["median_s"] <= out["p90_s"]
    assert out["method"].startswith("perf_counter around each call on cpu, 5 samples")


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="samples = 0"):
        kernel_timing.time_kernel(lambda: None, device="cpu", samples=0)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        kernel_timing.time_kernel(lambda: None, device="cpu", cuda_graph=True)


@cuda
def test_cuda_events_time_the_kernel_with_l2_flushed():
    x = torch.randn(4096, 4096, device="cuda")
    out = kernel_timing.time_kernel(lambda: x @ x, samples=10)
    assert out["method"].startswith("CUDA events") and "L2 flushed" in out["method"]
    flops = 2 * 4096**3 / out["median_s"]
    assert 1e12 < flops < 2e15                                      # a real GEMM's time, not a launch's


@cuda
def test_cuda_graph_replays_back_to_back_calls():
    x = torch.randn(1024, device="cuda")
    out = kernel_timing.time_kernel(lambda: x.mul_(1.0), cuda_graph=True, calls_per_sample=50, samples=5)
    assert out["method"].startswith("CUDA graph of 50") and out["median_s"] < 20e-6


@cuda
def test_copy_bandwidth_is_plausible():
    bw = kernel_timing.copy_bandwidth(mbytes=256)
    assert 1e11 < bw["bytes_per_s"] < 2e13


def test_end_to_end_decode_runs_fp16_then_int4_on_a_small_shape():
    from minillm.course.benchmarks.quant import end_to_end_decode
    from minillm.model.llama import tiny_config

    # tune_kernels=False: the engine build's timing step would compile both 2-byte builds of the decode
    # step (half a minute here), which this check of the benchmark's plumbing does not need
    row = end_to_end_decode(device="cpu", new_tokens=3, prompt_tokens=4, repeats=1, tune_kernels=False,
                            cfg=tiny_config(dim=128, ffn_dim=256, head_dim=32, n_heads=4, n_kv_heads=2))
    assert row["fp16_tok_s"] > 0 and row["int4_tok_s"] > 0
    assert row["int4_layer_weight_GB"] < 0.4 * row["fp16_layer_weight_GB"]      # int4 + scales < fp16
    assert row["int4_vs_fp16"] == row["int4_tok_s"] / row["fp16_tok_s"]
    assert row["engine_mode"] == "eager" and row["fp16_engine_tok_s"] > 0 and row["int4_engine_tok_s"] > 0
    assert row["fp16_engine_tokens_equal_greedy"] and row["int4_engine_tokens_equal_greedy"]
