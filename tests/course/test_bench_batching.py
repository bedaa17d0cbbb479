"""The helpers of `python -m minillm bench batching` (lesson 07): slicing, spreads, the ladder,
padding counts, and that every path the benchmark times produces the same greedy tokens."""
import math

import pytest
import torch

from helpers import CharTokenizer, random_prompts
from minillm import LLM
from minillm.course.benchmarks import batching as bb
from minillm.model.llama import random_model, tiny_config


def test_merge_slices_runs_them_back_to_back():
    a = {"wall": 2.0, "ttft": [0.5, 1.0], "tpot": [0.1, None], "tokens": [[1], [2]], "useful": 3, "computed": 4}
    b = {"wall": 3.0, "ttft": [1.5], "tpot": [0.2], "tokens": [[3]], "useful": 5, "computed": 8}
    m = bb.merge_slices([a, b])
    assert m["wall"] == 5.0
    assert m["ttft"] == [0.5, 1.0, 3.5]                       # the second slice starts when the first ends
    assert m["tpot"] == [0.1, None, 0.2] and m["tokens"] == [[1], [2], [3]]
    assert (m["useful"], m["computed"]) == (8, 12)


def runs(*walls):
    return [{"wall": w, "ttft": [1.0, 2.0], "tpot": [0.1, 0.3], "preempted": 0} for w in walls]


def test_spread_is_median_run_and_range():
    s = bb.spread(runs(4.0, 2.0, 5.0, 3.0), useful=100)
    assert s["output_tok_s"] == 100 / 4.0                     # even count: the slower of the middle two
    assert (s["output_tok_s_min"], s["output_tok_s_max"]) == (100 / 5.0, 100 / 2.0)
    assert bb.spread(runs(3.0, 1.0, 2.0), 10)["output_tok_s"] == 10 / 2.0


def test_knob_row_claims_a_difference_only_beyond_the_spread():
    center = bb.spread(runs(9.0, 10.0, 11.0), 100)
    assert not bb.knob_row("block_size", 64, runs(10.5, 11.5, 12.0), center, 100)["beyond_noise"]   # overlaps
    slower = bb.knob_row("block_size", 64, runs(12.0, 13.0, 14.0), center, 100)
    assert slower["beyond_noise"] and slower["output_tok_s"] == 100 / 13.0
    assert slower["ttft_p50_s"] == 1.5 and slower["tpot_p50_ms"] == pytest.approx(200.0)


def test_ladder_factors_multiply_to_the_whole_step():
    tok_s = {"hf_sequential": 20.0, "fast_sequential": 60.0, "continuous_1": 25.0, "continuous_16": 150.0,
             "continuous": 220.0}
    rows = bb.ladder(tok_s)
    assert [r["system"] for r in rows] == [system for system, _ in bb.LADDER]
    assert rows[0]["factor"] is None and rows[2]["factor"] == 25.0 / 60.0
    assert math.prod(r["factor"] for r in rows[1:]) == pytest.approx(220.0 / 20.0)


def test_run_hf_counts_padded_rows(transformers):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    r = bb.run_hf(hf, [[5, 6, 7], [8]], [2, 5], batch_size=2, pad_id=0)
    assert [len(t) for t in r["tokens"]] == [2, 5]
    assert (r["useful"], r["computed"]) == (7, 10)            # both rows run until the longer one is done


def test_every_timed_path_gives_the_same_greedy_tokens():
    """fast_sequential, continuous_1, continuous and static: the same tokens in fp32 (tiny model)."""
    model = random_model(tiny_config(), seed=0)
    prompts, outputs = random_prompts([7, 20, 3], model.cfg.vocab_size), [6, 2, 9]
    llm = LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=64, max_num_seqs=1)
    alone = bb.run_one_at_a_time(llm, prompts, outputs)
    assert [len(t) for t in alone["tokens"]] == outputs
    assert alone["ttft"] == sorted(alone["ttft"]) and alone["wall"] > 0    # queued one after another
    assert bb.run_fresh_engine(llm, prompts, outputs)["tokens"] == alone["tokens"]
    assert llm._engine is None                                              # the KV pool was freed
    batched = LLM(model=model, tokenizer=CharTokenizer(), device="cpu", max_model_len=64)
    assert bb.run_engine(batched, prompts, outputs)["tokens"] == alone["tokens"]
    assert bb.run_static(model, prompts, outputs, 2)["tokens"] == alone["tokens"]


def test_workloads_are_named_and_an_unknown_one_is_refused():
    assert bb.WORKLOADS["main"][:2] == (64, (16, 512)) and bb.WORKLOADS["held-out"][:3] == (24, (10, 300), (16, 128))
    assert bb.WORKLOADS["main"][3] != bb.WORKLOADS["held-out"][3]         # another seed: other requests
    with pytest.raises(ValueError, match="workload = 'nope'; allowed: 'main', 'held-out'"):
        bb.run(quick=True, workload="nope")


def test_bench_cli_passes_workload_and_json_path_only_to_benchmarks_that_take_them(monkeypatch, tmp_path):
    import types

    from minillm import __main__ as cli
    from minillm.course import benchmarks

    seen = {}

    def run(quick, dtype="bfloat16", workload="main", json_path=None):
        seen.update(quick=quick, dtype=dtype, workload=workload, json_path=json_path)
        return {"results": [], "summary": {}}

    monkeypatch.setattr(benchmarks, "load", lambda name: types.SimpleNamespace(run=run))
    monkeypatch.setattr("minillm.course.benchmarks.common.write_json", lambda doc, path: path)
    out = str(tmp_path / "b.json")
    cli.main(["bench", "batching", "--quick", "--workload", "held-out", "--dtype", "float32", "--json", out])
    assert seen == {"quick": True, "dtype": "float32", "workload": "held-out", "json_path": out}
    monkeypatch.setattr(benchmarks, "load", lambda name: types.SimpleNamespace(run=lambda quick: {}))
    with pytest.raises(SystemExit, match="has no --workload"):
        cli.main(["bench", "gqa", "--workload", "held-out"])
