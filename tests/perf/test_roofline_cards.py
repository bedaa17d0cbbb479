"""The roofline helpers behind lessons 01-03's interview cards (minillm/perf/roofline.py, issue 41): each one agrees
with the definitions it is built from, at its edges."""
import math

import pytest

from minillm.perf import roofline as r


def test_published_shapes_have_their_published_sizes():
    assert abs(r.QWEN25_7B.num_parameters() / 1e9 - 7.61) < 0.01        # Qwen2.5-7B model card: 7.61B
    assert abs(r.LLAMA2_13B.num_parameters() / 1e9 - 13.0) < 0.05       # Llama 2 paper: 13B
    assert r.kv_bytes_per_token(r.LLAMA2_13B, 2) == 800 * 1024           # MHA: 40 layers x 40 heads x 128 x 2 x 2


@pytest.mark.parametrize("target, context", [(1500, 0), (1500, 1024), (3000, 1024), (3000, 8192)])
def test_batch_for_throughput_is_the_smallest_batch_that_reaches_the_rate(target, context):
    b = r.batch_for_throughput(r.QWEN25_7B, "A100 80GB", 2, target, context)
    rate = lambda n: n / r.decode_step_seconds(r.QWEN25_7B, "A100 80GB", 2, n, context)  # noqa: E731
    assert rate(b) >= target and (b == 1 or rate(b - 1) < target)


def test_batch_for_throughput_is_inf_above_the_compute_roof():
    roof = r.GPUS["A100 80GB"]["flops"] / r.decode_flops_per_token(r.QWEN25_7B, 0)
    assert r.batch_for_throughput(r.QWEN25_7B, "A100 80GB", 2, 1.01 * roof) == math.inf


def test_tensor_parallel_divides_the_step_and_a_pipeline_does_not():
    one = r.decode_step_seconds(r.LLAMA2_70B, "A100 80GB", 2)
    assert r.tensor_parallel_step_seconds(r.LLAMA2_70B, "A100 80GB", 2, 4) == pytest.approx(one / 4)
    assert r.tensor_parallel_step_seconds(r.LLAMA2_70B, "A100 80GB", 2, 1) == one


def test_generation_with_and_without_cache():
    same = dict(cfg=r.LLAMA3_8B, gpu="H100 SXM", bytes_per_param=2, prompt=16)
    assert r.generation_seconds(new_tokens=1, use_cache=False, **same) == r.generation_seconds(new_tokens=1, **same)
    short = r.generation_seconds(new_tokens=64, use_cache=False, **same) / r.generation_seconds(new_tokens=64, **same)
    long = r.generation_seconds(new_tokens=2048, use_cache=False, **same) / r.generation_seconds(new_tokens=2048, **same)
    assert short == pytest.approx(1, abs=0.01) and long > 3          # below the ridge a recompute is memory-bound too


def test_prefill_compute_bound_tokens_is_where_flops_take_over():
    t = r.prefill_compute_bound_tokens(r.LLAMA3_8B, "H100 SXM", 2)

    def flop_time(n):
        return r.prefill_flops(r.LLAMA3_8B, n) / r.GPUS["H100 SXM"]["flops"]

    assert r.prefill_seconds(r.LLAMA3_8B, "H100 SXM", 2, t) == flop_time(t)
    assert r.prefill_seconds(r.LLAMA3_8B, "H100 SXM", 2, t - 1) > flop_time(t - 1)
    assert 0.9 * r.ridge_point("H100 SXM") < t < 1.2 * r.ridge_point("H100 SXM")
