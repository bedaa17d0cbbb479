"""The real-case calculator (minillm/parallel/calculator.py): its times follow from the published
peaks and the counted bytes, checked here by hand for Llama-3-70B on H200s."""
from __future__ import annotations

import pytest

from minillm.parallel.calculator import (LINKS, pipeline_parallel_step, pp_bytes_per_token, ring_all_reduce_seconds,
                                         table, tensor_parallel_step, tp_bytes_per_token)
from minillm.perf.roofline import GPUS, LLAMA3_70B, decode_bytes_per_step


def test_bytes_per_token_formulas():
    assert tp_bytes_per_token(LLAMA3_70B, 2) == 2 * 80 * 8192 * 2            # 2 all-reduces x 80 layers x 8192 x bf16
    assert pp_bytes_per_token(LLAMA3_70B, 4, 2) == 3 * 8192 * 2              # 3 boundaries
    assert pp_bytes_per_token(LLAMA3_70B, 1, 2) == 0


def test_ring_all_reduce_sends_2_n_minus_1_over_n_of_the_payload():
    assert ring_all_reduce_seconds(1e6, 1, "NVLink 4") == 0
    assert ring_all_reduce_seconds(1e6, 8, "NVLink 4") == pytest.approx(2 * 7 / 8 * 1e6 / 450e9)
    assert ring_all_reduce_seconds(1e6, 2, "InfiniBand NDR", latency_s=1e-5) == pytest.approx(1e6 / 50e9 + 1e-5)


def test_tensor_parallel_splits_the_weight_reads_and_pays_2_all_reduces_per_layer():
    one = tensor_parallel_step(LLAMA3_70B, "H200", 1)
    eight = tensor_parallel_step(LLAMA3_70B, "H200", 8)
    assert one["weights_s"] == pytest.approx(decode_bytes_per_step(LLAMA3_70B, 2, 0) / GPUS["H200"]["bandwidth"])
    assert eight["weights_s"] == pytest.approx(one["weights_s"] / 8)
    assert eight["messages_per_step"] == 160 and one["comm_s"] == 0
    assert eight["comm_s"] == pytest.approx(160 * 2 * 7 / 8 * 8192 * 2 / LINKS["NVLink 4"])
    assert not one["fits"] and eight["fits"]                                # 141 GB of bf16 weights > one H200


def test_pipeline_parallel_keeps_the_latency_and_multiplies_the_throughput():
    one = pipeline_parallel_step(LLAMA3_70B, "H200", 1)
    four = pipeline_parallel_step(LLAMA3_70B, "H200", 4)
    assert four["token_latency_s"] >= one["token_latency_s"]               # every stage in turn + 3 sends
    assert four["tokens_per_s"] == pytest.approx(4 * one["tokens_per_s"], rel=1e-3)
    assert four["comm_s"] == pytest.approx(3 * 8192 * 2 / LINKS["InfiniBand NDR"])


def test_tp_over_infiniband_costs_more_than_it_saves_where_nvlink_does_not():
    nv = tensor_parallel_step(LLAMA3_70B, "H200", 8, batch=64, context=4096, link="NVLink 4")
    ib = tensor_parallel_step(LLAMA3_70B, "H200", 8, batch=64, context=4096, link="InfiniBand NDR")
    assert ib["comm_s"] == pytest.approx(9 * nv["comm_s"])                  # 450 / 50 GB/s
    assert nv["comm_s"] < 0.2 * nv["weights_s"] < ib["comm_s"]


def test_table_has_tp_and_pp_rows_for_1_to_8():
    rows = table(LLAMA3_70B)
    assert [(r["mode"], r["gpus"]) for r in rows] == [("TP", n) for n in range(1, 9)] + [("PP", n) for n in range(1, 9)]


def test_gpipe_schedule_idles_the_bubble_fraction():
    from minillm.parallel.pipeline import gpipe_schedule
    from minillm.course.calculators import bubble_fraction
    for p, m in [(1, 4), (3, 1), (3, 4), (4, 12)]:
        slots = gpipe_schedule(p, m)
        span = max(t for _, _, t in slots) + 1
        assert span == m + p - 1
        assert len({(s, t) for s, _, t in slots}) == p * m              # a stage does one micro-batch at a time
        assert 1 - len(slots) / (p * span) == pytest.approx(bubble_fraction(p, m))


def test_figure_trace_is_the_split_shard_model_makes():
    from minillm.course.figures import tp_split_trace
    spans = tp_split_trace(3)
    assert [(r.start, r.stop) for r, _ in spans] == [(0, 6), (6, 12), (12, 18)]    # W_up rows: contiguous, complete
    assert [c for _, c in spans] == [r for r, _ in spans]                          # W_down columns: the same features
