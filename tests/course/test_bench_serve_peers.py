"""bench serve-peers' plumbing without vLLM: the sweep's points, the generator's options (vLLM's `bench serve`
flags for goodput, percentiles and greedy), GuideLLM's command and the rows read from its report, the engine-alone
closed loop, the commands each server starts with, and a server that dies while starting named with its log."""
import sys

import pytest

from minillm.course.benchmarks import serve_peers


def test_the_sweep_covers_the_concurrencies_then_the_shared_prefix():
    plan = serve_peers.points(serve_peers.settings(False))
    assert [p["concurrency"] for p in plan if p["workload"] == "random"] == list(serve_peers.CONCURRENCY)
    assert all(p["prompts"] >= 4 * p["concurrency"] for p in plan)
    assert plan[-1] == {"workload": "shared-prefix", "concurrency": 8, "prompts": 32, "prefix_len": 256}


def test_the_generator_asks_for_goodput_percentiles_and_greedy_fixed_lengths(tmp_path):
    args = serve_peers.generator_args("http://127.0.0.1:1", tmp_path, 8, 32, 64, 0, tmp_path / "r.json")
    joined = " ".join(args)
    assert "--goodput ttft:2000 tpot:200" in joined and "--ignore-eos" in args and "--temperature 0" in joined
    assert "--max-concurrency 8" in joined and "--num-prompts 32" in joined and "--random-output-len 64" in joined
    assert "--metric-percentiles 50,99" in joined and "--result-filename r.json" in joined


def test_both_servers_start_with_the_same_batch_limit_and_prefix_caching(tmp_path):
    ours, _ = serve_peers.server_command("minillm", tmp_path)
    assert ours[:4] == [sys.executable, "-m", "minillm", "serve"]
    assert "--enable-prefix-caching" in ours and ours[ours.index("--max-num-seqs") + 1] == "64"
    assert ours[ours.index("--served-model-name") + 1] == serve_peers.SERVED_NAME


def test_a_server_that_dies_while_starting_is_reported_with_its_log(tmp_path, monkeypatch):
    crash = [sys.executable, "-c", "print('cannot load the weights'); raise SystemExit(3)"]
    monkeypatch.setattr(serve_peers, "server_command", lambda name, folder: (crash, None))
    with pytest.raises(RuntimeError, match="exited with code 3(.|\n)*cannot load the weights"):
        serve_peers.Server("minillm", tmp_path)


def test_server_means_split_ttft_into_queue_and_prefill_from_the_metrics_text():
    def text(queue_sum, prefill_sum, count):           # vLLM labels its histograms by model and engine
        lines = []
        for name, total in (("vllm:request_queue_time_seconds", queue_sum),
                            ("vllm:request_prefill_time_seconds", prefill_sum)):
            lines += [f"# TYPE {name} histogram", f'{name}_bucket{{engine="0",le="+Inf"}} {count}',
                      f'{name}_sum{{engine="0"}} {total}', f'{name}_count{{engine="0"}} {count}']
        return "\n".join(lines) + "\n"

    before, after = serve_peers.histogram_totals(text(1.0, 2.0, 4)), serve_peers.histogram_totals(text(3.0, 2.5, 8))
    means = serve_peers.server_means(before, after)
    assert means["queue_ms"] == 500.0 and means["prefill_ms"] == 125.0
    assert means["server_ttft_ms"] is None and means["decode_ms"] is None        # absent: no requests counted


def test_guidellm_runs_its_concurrent_profile_on_completions_with_fixed_lengths(tmp_path, monkeypatch):
    monkeypatch.setattr(serve_peers, "guidellm_path", lambda: tmp_path / "guidellm")
    command = serve_peers.guidellm_command("http://127.0.0.1:1", tmp_path, 8, 32, 64, tmp_path / "g.json")
    options = dict(zip(command[2::2], command[3::2]))
    assert command[1] == "run" and "--disable-console" in command
    assert options["--profile"] == "kind=concurrent,streams=8"
    assert options["--constraint"] == "kind=max_requests,count=32"
    assert options["--data"] == "kind=synthetic_text,prompt_tokens=128,output_tokens=64"
    assert "request_format=/v1/completions" in options["--backend"] and "model=smollm2" in options["--backend"]
    assert options["--output"] == f"kind=json,path={tmp_path / 'g.json'}"


def test_guidellm_rows_read_its_report_in_ms_and_its_latency_in_seconds():
    def dist(p50, p99):
        return {"successful": {"percentiles": {"p50": p50, "p99": p99}}}

    bench = {"config": {"strategy": {"streams": 4}},
             "metrics": {"request_totals": {"successful": 16, "errored": 0},
                         "output_tokens_per_second": {"successful": {"mean": 120.5}},
                         "time_to_first_token_ms": dist(90.0, 200.0), "inter_token_latency_ms": dist(30.0, 41.0),
                         "request_latency": dist(2.0, 2.5)}}
    failed = {"config": {"strategy": {"streams": 8}},
              "metrics": {"request_totals": {"successful": 0, "errored": 3},
                          "output_tokens_per_second": {"successful": {"mean": 0.0}}}}
    row, none = serve_peers.guidellm_rows({"benchmarks": [bench, failed]})
    assert row == {"concurrency": 4, "completed": 16, "errored": 0, "output_tok_s": 120.5, "ttft_p50_ms": 90.0,
                   "ttft_p99_ms": 200.0, "tpot_p50_ms": 30.0, "tpot_p99_ms": 41.0, "e2el_p50_ms": 2000.0}
    assert none["errored"] == 3 and none["output_tok_s"] == 0.0 and none["tpot_p50_ms"] is None


def test_engine_alone_keeps_at_most_the_concurrency_in_the_engine_and_finishes_every_request(monkeypatch):
    from minillm import LLM
    from minillm.model.llama import random_model, tiny_config

    from helpers import CharTokenizer

    llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=CharTokenizer(), max_model_len=256)
    monkeypatch.setattr(serve_peers, "INPUT_LEN", 12)
    in_engine, step = [], llm.engine.step
    monkeypatch.setattr(llm.engine, "step", lambda: (in_engine.append(len(llm.engine.requests)), step())[1])
    point = serve_peers.engine_alone(llm, concurrency=3, prompts=7, output_len=5)
    assert point["completed"] == 7 and point["output_tok_s"] > 0 and point["tpot_p50_ms"] > 0
    assert max(in_engine) == 3 and not llm.engine.has_unfinished()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_a_guidellm_run_that_fails_is_reported_with_its_stderr_and_the_server_log(tmp_path, monkeypatch):
    crash = [sys.executable, "-c", "import sys; sys.exit('no such backend')"]
    monkeypatch.setattr(serve_peers, "guidellm_command", lambda *args: crash)
    server = type("FakeServer", (), {"name": "minillm", "url": "http://127.0.0.1:1", "tail": lambda self: "log tail"})()
    with pytest.raises(RuntimeError, match="guidellm against minillm failed(.|\n)*no such backend(.|\n)*log tail"):
        serve_peers.drive_guidellm(server, tmp_path, 2, 4, 8)
