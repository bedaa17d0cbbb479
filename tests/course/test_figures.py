"""The concept figures (minillm/course/figures.py): every file is drawn by the one command, and the
mechanism figures show what the code did, because they are drawn from its traces."""
import math

import pytest
import torch

from minillm.__main__ import main
from minillm.course import figures
from minillm.model.llama import random_model, tiny_config


def test_one_command_draws_every_figure(tmp_path, capsys):
    assert main(["figures", "--quick", "--out", str(tmp_path)]) == 0
    for name in figures.FIGURES:
        path = tmp_path / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert path.stat().st_size < 250_000, name           # readable at lesson width, light in git
    assert capsys.readouterr().out.count("wrote ") == len(figures.FIGURES)


def test_every_figure_is_committed_and_embedded_in_a_lesson():
    lessons = "".join(p.read_text() for p in (figures.ROOT / "lessons").glob("*.md"))
    for name in figures.FIGURES:
        assert (figures.OUT_DIR / name).is_file(), f"run: python -m minillm figures ({name} is missing)"
        assert f"](figures/{name})" in lessons, f"{name} is not embedded in any lesson"


def test_block_table_is_the_block_managers_state():
    snaps = {s.event: s for s in figures.block_table_trace()}
    hit = snaps["B hits A's cached prefix"]
    assert hit.tables == {"A": [0, 1, 2], "B": [0, 1, 3]}         # B's two full blocks are A's
    assert hit.ref_counts == [2, 2, 1, 1, 0, 0]
    fork = snaps["C forks A"]
    assert fork.tables["C"] == [0, 1, 2] and fork.ref_counts == [3, 3, 2, 1, 0, 0]
    cow = snaps["C writes 'off'"]
    assert cow.copies == [(2, 4)]                                 # the shared last block is copied first
    assert cow.tables["C"] == [0, 1, 4] and cow.ref_counts == [3, 3, 1, 1, 1, 0]
    in_place = snaps["A writes 'away'"]
    assert in_place.copies == [] and in_place.tables["A"] == [0, 1, 2]
    held = figures.physical_contents(in_place)
    assert held[2] == ["ran", "away"] and held[4] == ["ran", "off"]


def test_block_table_figure_is_drawn_from_the_trace():
    from matplotlib.figure import Figure

    snap = figures.block_table_trace()[-1]
    ax = Figure().subplots()
    figures.draw_block_snapshot(ax, snap, [(2, 4)])
    texts = {t.get_text() for t in ax.texts}
    assert {"P2: ran away", "P4: ran off", "P5: free", "ref 3", "copy\nP2\n-> P4"} <= texts


@pytest.fixture(scope="module")
def workload():
    model = random_model(tiny_config(), seed=0)
    return (model, *figures.gantt_workload(model.cfg.vocab_size))


def test_gantt_steps_equal_the_engines_step_log(workload):
    model, prompts, max_tokens = workload
    trace, plans, log = figures.continuous_trace(model, prompts, max_tokens)
    assert len(trace.steps) == len(plans) == len(log)
    for step, plan, entry in zip(trace.steps, plans, log):
        assert len(step) == len(plan) == entry["num_seqs"] <= figures.GANTT_BATCH
        assert sum(n for _, _, n in plan) == entry["num_tokens"]
        assert sum(kind == "decode" for kind in step.values()) == entry["num_decodes"]
    for req, wanted in zip(trace.requests, max_tokens):          # one token per step it ran in
        assert sum(req in step for step in trace.steps) == wanted
    assert "idle" not in {kind for step in trace.steps for kind in step.values()}


def test_static_gantt_follows_generate_static(workload):
    model, prompts, max_tokens = workload
    trace, out = figures.static_trace(model, prompts, max_tokens)
    assert len(trace.steps) == out["steps"]
    assert sum(len(step) for step in trace.steps) == out["computed_tokens"]     # every row, idle or not
    for req, wanted in zip(trace.requests, max_tokens):
        assert sum(step.get(req) in ("prefill", "decode") for step in trace.steps) == wanted
    idle = sum(kind == "idle" for step in trace.steps for kind in step.values())
    assert idle == out["computed_tokens"] - out["useful_tokens"] > 0


def test_speculative_rounds_rebuild_the_greedy_output():
    from minillm import SamplingParams

    llm, prompt, _ = figures.speculative_example(quick=True)
    rounds, output = figures.speculative_trace(llm, prompt, "ngram", k=4, max_tokens=24)
    rebuilt = output[:1]
    for rnd in rounds:
        rebuilt += rnd.drafted[:rnd.accepted] + [rnd.target_token]
        if rnd.target_kind == "correction":
            assert rnd.drafted[rnd.accepted] != rnd.target_token        # the rejected guess was replaced
    assert rebuilt == output
    assert {r.target_kind for r in rounds} >= {"bonus", "correction"}
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert plain[0].outputs[0].token_ids == output


def test_online_softmax_state_comes_from_the_librarys_lse():
    trace = figures.online_softmax_trace()
    scores = torch.tensor(trace.scores)
    assert trace.m == sorted(trace.m) and len(set(trace.m)) > 2                # the max rises, more than once
    for j, (m, l) in enumerate(zip(trace.m, trace.l), start=1):
        seen = scores[:j * trace.block_n]
        assert m == pytest.approx(float(seen.max()))
        assert l == pytest.approx(float(torch.exp(seen - m).sum()), rel=1e-5)
    assert trace.m[-1] + math.log(trace.l[-1]) == pytest.approx(float(torch.logsumexp(scores, 0)), rel=1e-5)


def test_radix_tree_figure_is_the_trees_state():
    root, hits = figures.radix_tree_trace(block_size=4)
    # the 9-word system prompt fills two blocks; its last word runs again in every request
    assert hits == {"chat 1, turn 1": 0, "chat 1, turn 2": 20, "chat 2": 8, "few-shot": 8}
    (trunk,) = root.children
    assert trunk.words == figures.RADIX_SYSTEM[:8] and len(trunk.children) == 3
    turn1 = next(c for c in trunk.children if c.words[:3] == ["line", "user", ":"] and c.children)
    assert [c.words[:3] for c in turn1.children] == [["and", "values", "kept"]]   # turn 2 extends turn 1
    finished = next(c for c in trunk.children if "paging" in c.words)
    assert not finished.held and trunk.held and turn1.held                     # chat 2 ended: cached only


def test_kv_cache_benchmark_puts_its_plot_beside_its_json(tmp_path, monkeypatch):
    """A run with --json elsewhere (another machine's file) must not overwrite results/kv-cache-latency.png."""
    from minillm.loading import loader
    from minillm.course.benchmarks import kv_cache as bench

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: (random_model(tiny_config(), seed=0), None))
    monkeypatch.setattr(bench, "batch1_vs_hf", lambda dtype, n: {"dtype": dtype, "ours_vs_hf": 1.0, "fraction_of_bound": 1.0, "decode_build": "default"})  # real model
    monkeypatch.chdir(tmp_path)
    bench.run(quick=True, json_path=str(tmp_path / "kv-cache-other.json"))
    assert (tmp_path / "kv-cache-other-latency.png").is_file()
    assert not (tmp_path / "results" / "kv-cache-latency.png").exists()
