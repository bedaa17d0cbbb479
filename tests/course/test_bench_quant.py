"""bench quant's activations part (minillm/course/benchmarks/quant.py) on a tiny random model: where the outliers are
and what SmoothQuant does to them (outlier_sites), the part names it accepts, and the int8 GEMM's rows."""
import pytest
import torch

from helpers import random_prompts
from minillm.course.benchmarks import quant
from minillm.model.llama import random_model, tiny_config


def test_outlier_sites_find_a_blown_up_channel_and_smoothing_recovers_it():
    cfg = tiny_config()
    model = random_model(cfg, seed=0)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn_norm.weight[5] *= 40                        # one massive channel at every q/k/v input
    calibration = torch.tensor(random_prompts([24, 24, 24], cfg.vocab_size, seed=1))
    held_out = torch.tensor(random_prompts([20], cfg.vocab_size, seed=2))
    out = quant.outlier_sites(model, calibration, held_out, alpha=0.5)["sites"]
    qkv = out["qkv"]
    assert len(qkv["per_layer"]) == cfg.n_layers
    assert qkv["median_range"] > 5 * out["gate_up"]["median_range"]           # the blown-up input stands out
    assert qkv["median_levels_smoothed"] > 2 * qkv["median_levels_plain"]
    assert qkv["median_err_smoothed"] < qkv["median_err_plain"] / 2


def test_bench_quant_refuses_an_unknown_part():
    with pytest.raises(ValueError, match="'weights', 'activations'"):
        quant.run(quick=True, part="kv")


def test_the_int8_gemm_rows_say_what_the_cpu_lists():
    got = quant.int8_gemm(quick=True)
    assert set(got["cpu_flags"]) == {"avx512_vnni", "avx_vnni", "amx_int8", "avx512_bf16"}
    assert [r["rows"] for r in got["results"]] == [16, 64]
    assert all(r["int8_GFLOP_s"] > 0 and r["bf16_GFLOP_s"] > 0 for r in got["results"])
