"""bench engine-step: the roofline of a batched decode step and the token comparison with transformers."""
import pytest
import torch

from minillm.benchmarks import engine_step
from minillm.model import tiny_config


def test_step_roofline_is_the_slower_of_reading_the_weights_and_the_gemm():
    cfg = tiny_config()
    params = cfg.num_parameters()
    # 4 bytes per fp32 weight at 1e9 B/s; 2 FLOPs per weight and row at 1e12 FLOP/s
    read_bound = engine_step.step_roofline(cfg, torch.float32, 2, bandwidth=1e9, gemm_rate=1e12)
    assert read_bound["read_ms"] == pytest.approx(4 * params / 1e6)
    assert read_bound["gemm_ms"] == pytest.approx(2 * params * 2 / 1e9)
    assert read_bound["bound_tok_s"] == pytest.approx(2 / (4 * params / 1e9))
    gemm_bound = engine_step.step_roofline(cfg, torch.bfloat16, 1000, bandwidth=1e12, gemm_rate=1e9)
    assert gemm_bound["bound_tok_s"] == pytest.approx(1000 / (2 * params * 1000 / 1e9))


def test_tokens_are_compared_only_up_to_the_first_end_of_sequence():
    assert engine_step.before_eos([5, 6, 2, 7], eos=2) == [5, 6]
    assert engine_step.before_eos([5, 6, 7], eos=2) == [5, 6, 7]
