"""Calibration that generalises (issue 19): the scoring domains, the calibration sources of
quant.calibration_windows, and `python -m minillm bench calibration`, on a tiny random model."""
import re

import pytest
import torch

from helpers import CharTokenizer
from minillm.evaluate import DOMAINS, calibration_text, domain_text, evaluation_text, token_windows
from minillm.model.llama import random_model, tiny_config
from minillm.quant import CALIBRATION_SOURCES, calibration_windows, model_samples


class TextTokenizer(CharTokenizer):
    """CharTokenizer that can also encode: one id (3..92) per character, no BOS (EOS 2 starts samples)."""

    def encode(self, text):
        return [3 + ord(c) % 90 for c in text]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine their many small ops lose
    much time to thread hand-offs: one thread keeps this file fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def paragraphs(text):
    return {p.strip() for p in re.split(r"\n\s*\n", text) if len(p.strip()) > 120}


def test_domains_load_python_docs_first_and_are_substantial():
    assert DOMAINS[0] == "python-docs" and len(DOMAINS) >= 3
    assert domain_text("python-docs") == evaluation_text()
    texts = {name: domain_text(name) for name in DOMAINS}
    for name, text in texts.items():
        assert len(text) > 10_000, name                        # a few thousand tokens at least
    assert "GNU GENERAL PUBLIC LICENSE" in texts["gpl-3"] and "Kibaale" in texts["vim-charity"]
    assert "Apache License" in texts["apache-mpl"] and "Mozilla Public License" in texts["apache-mpl"]
    assert sum(len(texts[n].encode()) for n in DOMAINS[1:]) < 200_000


def test_domains_are_disjoint_from_the_calibration_text_and_from_each_other():
    calibration = calibration_text()
    cal_paragraphs = paragraphs(calibration)
    for name in DOMAINS:
        assert not paragraphs(domain_text(name)) & cal_paragraphs, name
    for name in DOMAINS[1:]:                                   # not even a sentence of a license in it
        lines = [line.strip() for line in domain_text(name).splitlines() if len(line.strip()) > 60]
        assert lines and not any(line in calibration for line in lines), name
    for a in DOMAINS:
        for b in DOMAINS:
            if a < b:
                assert not paragraphs(domain_text(a)) & paragraphs(domain_text(b)), (a, b)


def test_unknown_domain_and_source_are_clear_errors():
    with pytest.raises(ValueError, match=r"domain 'wikitext' is unknown; allowed: 'python-docs', 'gpl-3'"):
        domain_text("wikitext")
    with pytest.raises(ValueError, match=r"calibration source 'c4' is unknown; allowed: 'python-docs', "
                                         r"'model-samples', 'mixed'"):
        calibration_windows(TextTokenizer(), 2, 64, source="c4")
    with pytest.raises(ValueError, match="pass model="):
        calibration_windows(TextTokenizer(), 2, 64, source="model-samples")
    with pytest.raises(ValueError, match="n_windows"):
        calibration_windows(TextTokenizer(), 0, 64)
    with pytest.raises(ValueError, match="temperature"):
        model_samples(random_model(tiny_config()), 1, 8, temperature=0)


def test_python_docs_windows_are_unchanged_by_default():
    tok = TextTokenizer()
    expected = torch.tensor(token_windows(tok.encode(calibration_text()), 64, 3))
    assert torch.equal(calibration_windows(tok, 3, 64), expected)
    assert torch.equal(calibration_windows(tok, 3, 64, source="python-docs"), expected)
    assert CALIBRATION_SOURCES[0] == "python-docs"


def test_model_samples_are_deterministic_for_a_seed_and_shaped(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    model, tok = random_model(tiny_config(), seed=0), TextTokenizer()
    a = calibration_windows(tok, 3, 40, source="model-samples", model=model, seed=7, cache=False)
    assert a.shape == (3, 40) and a.dtype == torch.long
    assert (a[:, 0] == tok.eos_token_id).all()                 # no BOS: every window starts at EOS
    assert int(a.min()) >= 0 and int(a.max()) < model.cfg.vocab_size
    assert len({tuple(row.tolist()) for row in a}) == 3        # each window its own text
    assert torch.equal(a, calibration_windows(tok, 3, 40, source="model-samples", model=model, seed=7, cache=False))
    assert not torch.equal(a, calibration_windows(tok, 3, 40, source="model-samples", model=model, seed=8, cache=False))
    # window i has its own generator: fewer windows are a prefix, batching does not matter
    assert torch.equal(a[:2], model_samples(model, 2, 40, start_token=tok.eos_token_id, seed=7, batch=1))
    # cached on disk once, then read back
    cached = calibration_windows(tok, 3, 40, source="model-samples", model=model, seed=7)
    files = list((tmp_path / "calibration").glob("model-samples-*.pt"))
    assert torch.equal(cached, a) and len(files) == 1
    assert torch.equal(calibration_windows(tok, 3, 40, source="model-samples", model=model, seed=7), a)
    other = random_model(tiny_config(), seed=1)                 # other weights: other samples, another file
    assert not torch.equal(calibration_windows(tok, 3, 40, source="model-samples", model=other, seed=7), a)
    assert len(list((tmp_path / "calibration").glob("model-samples-*.pt"))) == 2


def test_mixed_is_python_docs_then_model_samples(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    model, tok = random_model(tiny_config(), seed=0), TextTokenizer()
    mixed = calibration_windows(tok, 5, 32, source="mixed", model=model, seed=3)
    assert mixed.shape == (5, 32)
    assert torch.equal(mixed[:3], calibration_windows(tok, 3, 32))
    assert torch.equal(mixed[3:], calibration_windows(tok, 2, 32, source="model-samples", model=model, seed=3))


def test_sampled_windows_calibrate_gptq_on_a_tiny_model(tmp_path, monkeypatch):
    from minillm.quant import quantize_model
    from minillm.quant.linear import QuantLinear

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    model = random_model(tiny_config(), seed=0)
    ids = calibration_windows(TextTokenizer(), 4, 64, source="model-samples", model=model)
    quantize_model(model, "gptq", group_size=32, calibration_ids=ids)
    assert all(isinstance(m, QuantLinear) for n, m in model.named_modules() if n.endswith(("wq", "w_down")))


# ---- the benchmark ------------------------------------------------------------------------------

def fake_rows():
    ppl = {   # config -> per domain; gptq on python-docs loses on gpl-3, everything else wins
        ("fp32", 32, "none", 0): (10, 5, 6),
        ("rtn", 4, "none", 0): (14, 7, 8),
        ("gptq", 4, "python-docs", 8): (12, 7.5, 7),
        ("awq", 4, "python-docs", 8): (13, 6.5, 7.5),
        ("gptq", 4, "model-samples", 8): (13, 6, 7),
        ("awq", 4, "model-samples", 8): (13.5, 6.9, 7.9),
    }
    rows = []
    for (method, bits, source, n), values in ppl.items():
        for domain, v in zip(("python-docs", "gpl-3", "vim-charity"), values):
            rows.append(dict(method=method, bits=bits, calibration=source, n_windows=n, variant="default",
                             part="main", domain=domain, ppl=float(v)))
    rows += [dict(r, n_windows=32, part="ablation", ppl=r["ppl"] * 0.1) for r in rows if r["method"] == "gptq"]
    return rows


def test_summarise_says_which_source_beats_rtn_on_every_domain():
    from minillm.course.benchmarks.calibration import summarise

    s = summarise(fake_rows())
    assert s["domains"] == ["python-docs", "gpl-3", "vim-charity"]
    assert s["beats_rtn_everywhere"] == {"python-docs": {"n8": {"gptq-4bit": False, "awq-4bit": True}},
                                         "model-samples": {"n8": {"gptq-4bit": True, "awq-4bit": True}}}
    assert s["calibrations_that_beat_rtn_everywhere"] == ["model-samples-n8"]
    assert s["vs_rtn"]["gptq-4bit-python-docs-n8"]["gpl-3"] == pytest.approx(7.5 / 7)
    assert s["beats_rtn_everywhere_by_config"]["gptq-4bit-python-docs-n32"]      # ablations: by config only
    assert s["ppl_increase_pct"]["rtn-4bit"]["python-docs"] == pytest.approx(40)


def test_full_grid_covers_every_source_at_4_and_3_bits():
    from minillm.course.benchmarks.calibration import config_key, grid

    specs = grid(quick=False)
    keys = [config_key(s) for s in specs]
    assert len(keys) == len(set(keys))
    main = {(s["method"], s["bits"], s["calibration"], s["n_windows"]) for s in specs if s["part"] == "main"}
    for bits in (4, 3):
        assert ("rtn", bits, "none", 0) in main
        assert all((m, bits, src, n) in main for m in ("gptq", "awq") for src in CALIBRATION_SOURCES for n in (8, 32))


def test_quick_run_on_a_tiny_model_writes_the_documented_keys(tmp_path, monkeypatch):
    import minillm.llm
    from minillm.course.benchmarks import calibration as bench
    from minillm.course.benchmarks.common import write_json

    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    real_llm = minillm.llm.LLM
    monkeypatch.setattr(minillm.llm, "LLM", lambda **kw: real_llm(model=random_model(tiny_config(), seed=0),
                                                                   tokenizer=TextTokenizer(), device="cpu",
                                                                   max_model_len=512))
    doc = bench.run(quick=True)
    assert doc["name"] == bench.NAME == "calibration"
    assert set(doc) == {"name", "machine", "config", "results", "summary"}
    configs = {r["config"] for r in doc["results"]}
    assert {"fp32", "rtn-4bit", "gptq-4bit-python-docs-n2", "awq-4bit-model-samples-n2"} <= configs
    for r in doc["results"]:
        assert {"method", "bits", "calibration", "n_windows", "variant", "domain", "ppl"} <= set(r)
        assert r["domain"] in DOMAINS and r["ppl"] > 1
    assert len(doc["results"]) == len(configs) * len(DOMAINS)
    s = doc["summary"]
    assert set(s["beats_rtn_everywhere"]) == set(bench.QUICK_SOURCES)
    assert all(set(v["n2"]) == {"gptq-4bit", "awq-4bit"} for v in s["beats_rtn_everywhere"].values())
    assert {"domains", "ppl", "vs_rtn", "calibrations_that_beat_rtn_everywhere", "ppl_increase_pct"} <= set(s)
    # an interrupted run resumes: the configs already in the partial document are not measured again
    path = write_json(doc, tmp_path / "calibration.json")
    monkeypatch.setattr(bench, "build", lambda *a: pytest.fail("a resumed config was built again"))
    again = bench.run(quick=True, partial_path=path, resume=True)
    assert again["config"]["resumed"] == again["config"]["configs"] and again["results"] == doc["results"]
