"""bench deepseek's parts that count rather than time: the latent pool's bytes against MHA and GQA, the
experts a step touches against the formula, the balance bias at work, and the gloo run's bytes; the timed
parts (absorbed against naive MLA, grouped against per-token experts) check their outputs equal first."""
import pytest

from minillm.course.benchmarks import deepseek
from minillm.course.calculators import experts_touched, parameters_of


def test_the_latent_pool_holds_576_values_per_token_and_layer_71x_fewer_than_mha():
    rows = {r["layout"].split(" (")[0]: r for r in deepseek.kv_rows()}
    assert rows["MLA latent"]["values_per_token_layer"] == 576
    mha, gqa = rows["expanded MHA"], rows["expanded GQA-8"]
    assert mha["values_per_token_layer"] == 128 * (192 + 128) and gqa["values_per_token_layer"] == 8 * 320
    assert mha["times_mla"] == pytest.approx(40960 / 576)


def test_deepseek_v3_counts_671b_weights_and_37b_active():
    assert round(parameters_of("deepseek-v3") / 1e9) == 671 and 36.5e9 < parameters_of("deepseek-v3", active=True) < 38e9
    assert round(parameters_of("mixtral-8x7b") / 1e8) == 467 and round(parameters_of("mixtral-8x7b", True) / 1e8) == 129


def test_the_router_touches_about_as_many_experts_as_even_routing_predicts():
    rows = deepseek.experts_rows(quick=True)
    assert rows[0]["touched_router"] == 8                              # one token: its top 8
    for r in rows:
        assert abs(r["touched_router"] / r["touched_formula"] - 1) < 0.1
    assert rows[-1]["step_weight_GB_fp8"] > 10 * rows[0]["step_weight_GB_fp8"]


def test_the_bias_update_evens_the_load():
    (row,) = deepseek.balance_rows()
    assert row["imbalance_by_step"][0] > 2 and max(row["imbalance_by_step"][-10:]) < 1.6


def test_absorbed_and_naive_mla_agree_before_they_are_timed():
    rows = deepseek.absorb_rows(quick=True)
    assert {r["phase"] for r in rows} == {"decode", "prefill"} and all(r["naive_over_absorbed"] > 0 for r in rows)
    assert rows[0]["cache_values_per_token_expanded"] == 16 * 320 and rows[0]["cache_values_per_token_latent"] == 576


def test_expert_parallel_bytes_are_near_the_formula_and_fewer_than_tp_for_the_same_batch():
    rows = deepseek.ep_rows()
    assert rows[0]["bytes_rank0"] > 0 and abs(rows[0]["measured_over_formula"] - 1) < 0.2
    eight, many = rows[1]["ep_over_tp_same_batch"], rows[2]["ep_over_tp_same_batch"]
    assert many < eight < 1                                            # each GPU sends only its own tokens' rows


def test_experts_touched_formula_limits():
    assert experts_touched(1, 256, 8) == 8 and experts_touched(10_000, 256, 8) == pytest.approx(256)
