"""bench gpu-engine (issue 26 section 3): every measurement on a tiny model on CPU, the HF twin's fairness
(same logits, same greedy tokens), argument checks; the real sizes run only where CUDA is."""
import math

import pytest
import torch

from minillm.course.benchmarks import gpu_engine as ge
from minillm.kernel_support.args import INTERPRETED
from minillm.model.llama import random_model, tiny_config

CPU = dict(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def cfg():
    return tiny_config()


def test_decode_bound_tiny(cfg):
    d = ge.decode_bound(**CPU, new_tokens=6, prompt_tokens=4, repeats=2, copy_mbytes=8, cfg=cfg)
    assert [r["system"] for r in d["rows"]] == ["generate", "engine_eager"]     # graphs: CUDA only
    for row in d["rows"]:
        assert row["decode_tok_s"] > 0 and row["end_to_end_tok_s"] > 0
        assert 0 < row["fraction_of_hbm_bound"] < 1.5
        assert row["tokens_equal_to_generate"]                                # fp32: every path, same tokens
    assert d["hbm_bound_tok_s"] > 0 and d["copy_bandwidth_GBps"] > 0
    assert d["weight_bytes"] == cfg.num_parameters() * 4 and d["kv_bytes_per_token_read"] > 0
    assert d["generate_path"] in ("contiguous batch-1 path", "engine") and d["shape"] == "custom"


def test_decode_bound_splits_the_bytes_of_an_untied_model():
    """Llama-2-7B's input embedding is untied: a decode step reads one row of it, not all of it. The H200
    run of 2026-12-04 printed a negative KV byte count (the whole embedding subtracted from the bytes read)."""
    untied = tiny_config(tie_embeddings=False)
    d = ge.decode_bound(**CPU, new_tokens=4, prompt_tokens=4, repeats=1, copy_mbytes=8, cfg=untied)
    kv = d["mean_context"] * 2 * untied.n_layers * untied.n_kv_heads * untied.head_dim * 4
    assert d["kv_bytes_per_token_read"] == kv > 0
    assert d["weight_bytes_read"] == (untied.num_parameters() - untied.vocab_size * untied.dim + untied.dim) * 4
    assert d["weight_bytes_read"] + kv == pytest.approx(d["copy_bandwidth_GBps"] * 1e9 / d["hbm_bound_tok_s"])


@pytest.mark.parametrize("tie", [True, False])
def test_hf_twin_has_our_logits(tie):
    pytest.importorskip("transformers")
    model = random_model(tiny_config(tie_embeddings=tie), seed=1)
    hf = ge.hf_twin(model)
    check = ge.logits_difference(model, hf, list(range(3, 40)))
    assert check["max_abs_diff"] <= 1e-4 and check["argmax_agreement"] == 1.0


def test_batching_vs_hf_tiny_same_tokens(cfg):
    pytest.importorskip("transformers")
    b = ge.batching_vs_hf(**CPU, num_requests=5, prompt_range=(4, 24), output_range=(3, 8), max_batch=2,
                          sequential_requests=3, repeats=1, cfg=cfg)
    assert b["logits_check"]["max_abs_diff"] <= 1e-4
    # our engine's greedy tokens are HF's, one at a time (the first 3 requests) and in padded batches
    assert b["requests_with_tokens_equal_to_engine"] == {"hf_padded": 1.0, "hf_sequential": 1.0}
    rows = {r["system"]: r for r in b["rows"]}
    assert set(rows) == {"continuous", "hf_padded", "hf_sequential"}
    assert all(r["output_tok_s"] > 0 for r in rows.values())
    assert rows["hf_sequential"]["output_tokens"] == sum(b["output_lengths"][:3])
    assert 0 <= rows["hf_padded"]["padding_waste"] < 1 and rows["hf_sequential"]["padding_waste"] == 0
    assert b["continuous_vs_hf_padded"] == pytest.approx(rows["continuous"]["output_tok_s"]
                                                         / rows["hf_padded"]["output_tok_s"])
    assert all(4 <= n <= 24 for n in b["prompt_lengths"]) and all(3 <= n <= 8 for n in b["output_lengths"])


def test_decode_vs_batch_tiny(cfg):
    s = ge.decode_vs_batch(**CPU, batches=(4, 1, 2), context=8, samples=3, copy_mbytes=8, matmul_n=64, cfg=cfg)
    assert [r["batch"] for r in s["rows"]] == [1, 2, 4]
    for row in s["rows"]:
        assert row["tok_s"] > 0 and row["roofline_tok_s"] > 0 and row["fraction_of_roofline"] > 0
    assert s["rows"][0]["linear_efficiency"] == 1.0
    assert s["roofline_compute_bound_batch"] > 0 and s["measured_asymptotes_meet_at_batch"] > 0
    assert s["matmul_TFLOPs"] > 0 and "time_kernel" in s["timing"]


@pytest.mark.skipif(not INTERPRETED, reason="the Triton path on CPU needs TRITON_INTERPRET=1")
def test_decode_batch_takes_the_cuda_graph_path():
    """The batch decode_vs_batch times is what DecodeGraphs replays on a GPU (all rows decode, tables fit):
    on CPU under the interpreter the graph's padded forward runs unrecorded and equals the eager step."""
    from minillm.engine.engine import Engine

    llm = ge.make_llm(random_model(tiny_config(), seed=0), "cpu", eager=False, max_model_len=10, max_num_seqs=4,
                      num_kv_blocks=9, block_size=4)
    engine = Engine(llm, triton_on_cpu=True)
    runner = engine.runner
    with pytest.raises(ValueError, match="exceed the KV pool's 9 blocks"):
        ge.decode_batch(runner, 4, 8, engine.decode_group_cost)              # 4 rows x 3 blocks of 4 positions
    batch = ge.decode_batch(runner, 3, 8, engine.decode_group_cost)
    assert runner.graphs is not None and runner.graphs.fits(batch)
    with torch.no_grad():
        padded = runner.forward(batch)                                       # (3, V) through bucket 4
        eager = runner.forward_eager(batch)
    assert runner.graphs.padded_steps == 1 and padded.shape == (3, llm.config.vocab_size)
    torch.testing.assert_close(padded, eager)


def test_knee_on_a_made_up_roofline():
    """Flat 10 ms steps up to batch 8, then 1.25 ms per row: tok/s stops being linear past 8."""
    batches = [1, 2, 4, 8, 16, 32, 64]
    tok_s = [b / max(0.010, b * 0.00125) for b in batches]
    k = ge.knee(batches, tok_s)
    assert k["first_batch_below_linear"] == 16
    assert k["asymptotes_meet_at_batch"] == pytest.approx(8.0)
    assert k["linear_efficiency"][:4] == [1.0, 1.0, 1.0, 1.0]


def test_roofline_batch_with_measured_rates():
    c = tiny_config()
    b = ge.roofline_batch(c, 2, 0, bandwidth=1e12, flops=1e14)
    assert b == pytest.approx(100.0)     # context 0: weights / bandwidth = batch x 2 FLOPs per weight / FLOP/s
    assert ge.roofline_batch(c, 2, 10**9, bandwidth=1e12, flops=1e14) == math.inf     # KV-bound forever


def test_random_workload_is_reproducible():
    a = ge.random_workload(6, (16, 256), (16, 128), 1000, seed=3)
    assert a == ge.random_workload(6, (16, 256), (16, 128), 1000, seed=3)
    assert all(3 <= t < 1000 for p in a[0] for t in p)


@pytest.mark.parametrize("call, allowed", [
    (lambda: ge.decode_bound("cpu", shape="llama9-1t"), "allowed: 'llama2-7b'"),
    (lambda: ge.decode_bound("cpu", new_tokens=1, cfg=tiny_config()), "allowed: >= 2"),
    (lambda: ge.decode_bound("cpu", repeats=0, cfg=tiny_config()), "allowed: an integer >= 1"),
    (lambda: ge.decode_bound("tpu"), "allowed: 'cuda' or 'cpu'"),
    (lambda: ge.decode_bound("cpu", dtype="int3", cfg=tiny_config()), "allowed: 'bfloat16'"),
    (lambda: ge.batching_vs_hf("cpu", max_batch=0, cfg=tiny_config()), "max_batch = 0"),
    (lambda: ge.batching_vs_hf("cpu", prompt_range=(30, 10), cfg=tiny_config()), "1 <= lo <= hi"),
    (lambda: ge.batching_vs_hf("cpu", num_requests=2, sequential_requests=3, cfg=tiny_config()),
     "allowed: 1..num_requests"),
    (lambda: ge.batching_vs_hf("cpu", prompt_range=(16, 500), cfg=tiny_config()), "positions"),
    (lambda: ge.decode_vs_batch("cpu", batches=(0, 1), cfg=tiny_config()), "integers >= 1"),
    (lambda: ge.decode_vs_batch("cpu", batches=(), cfg=tiny_config()), "non-empty"),
    (lambda: ge.decode_vs_batch("cpu", shape="gpt2"), "unknown shape"),
])
def test_bad_arguments_name_what_is_allowed(call, allowed):
    with pytest.raises(ValueError, match=allowed.replace("(", r"\(").replace(".", r"\.")):
        call()


def test_run_assembles_the_document_and_survives_a_failing_part(monkeypatch):
    """run() on CPU with tiny sizes (settings replaced): the document's keys, one row per system, and a
    part that raises is recorded while the others still run."""
    tiny = dict(cfg=tiny_config(), dtype="float32")
    monkeypatch.setattr(ge, "settings", lambda quick: {
        "decode_bound": dict(new_tokens=4, prompt_tokens=3, repeats=1, copy_mbytes=8, **tiny),
        "batching_vs_hf": dict(num_requests=3, prompt_range=(4, 8), output_range=(2, 4), max_batch=2,
                               sequential_requests=5, **tiny),                  # 5 > 3: this part fails
        "decode_vs_batch": dict(batches=(1, 2), context=4, samples=2, copy_mbytes=8, matmul_n=32, **tiny)})
    doc = ge.run("cpu", quick=True)
    assert set(doc) == {"name", "machine", "config", "results", "summary"} and doc["name"] == "gpu-engine"
    assert list(doc["config"]["errors"]) == ["batching_vs_hf"] and "sequential_requests" in \
        doc["config"]["errors"]["batching_vs_hf"]
    assert [r["part"] for r in doc["results"]] == ["decode_bound"] * 2 + ["decode_vs_batch"] * 2
    s = doc["summary"]
    assert set(s["goals_met"]) == {"fraction_of_hbm_bound"} and s["goals_met"]["fraction_of_hbm_bound"] is False
    assert s["decode_knee_roofline"] > 0 and "continuous_vs_hf_padded" not in s


def test_run_refuses_cuda_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no CUDA device"):
        ge.run("cuda", quick=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU sizes need CUDA")
def test_run_quick_on_cuda():
    doc = ge.run("cuda", quick=True)
    assert set(doc) == {"name", "machine", "config", "results", "summary"}
    assert doc["config"]["errors"] == {}
    s = doc["summary"]
    assert 0 < s["decode_best_fraction_of_hbm_bound"] < 1.5
    assert s["continuous_vs_hf_padded"] > 0 and s["continuous_vs_hf_sequential"] > 0
    assert s["hf_logits_max_abs_diff"] < 1.0                                 # bf16: close, not equal
    parts = doc["config"]["parts"]
    if parts["decode_bound"]["cuda_graphs_measured"]:
        assert parts["decode_bound"]["graph_replays"]["engine_graphs"] > 0
        assert parts["decode_vs_batch"]["graph_replays"] > 0
