"""Does GPTQ / AWQ calibration generalise? Perplexity on every scoring domain, per calibration source.

    python -m minillm bench calibration [--quick] [--json results/calibration.json]

GPTQ and AWQ fit their statistics (Hessians, scales, clipping) to calibration text. The quant
benchmark calibrates on Python's docs and scores on other Python docs: one domain. Here every
quantised model is scored on each of evaluate.DOMAINS (Python's docs and English texts of other
kinds, none ever calibrated on), against plain round-to-nearest (RTN, int4/int3 g128) of the same
bits, for each calibration source of quant.calibration_windows:

    python-docs     windows of evaluate.calibration_text() (what LLM(quantization=...) uses)
    model-samples   text sampled from the model itself (LLM-QAT's data-free idea), BOS then temperature 1
    mixed           half of each

The main grid runs every source at 8 windows of 512 tokens (what LLM uses) and at 32; the full
run adds ablations on Python's docs: 4 windows (the quant benchmark's), GPTQ damping 0.1 instead
of 0.01, GPTQ without act-order. Rows: (method, bits, calibration, n_windows, variant, part,
domain, ppl). summary.beats_rtn_everywhere says, per calibration source and size, whether GPTQ and
AWQ at 4 and 3 bits are below RTN's perplexity on every domain. fp32 rows: the unquantised model.
Perplexity: evaluate.perplexity, non-overlapping windows, at most eval_windows per domain.
"""
from __future__ import annotations

import copy
import time

import torch

from . import common

NAME = "calibration"
DEFAULT_N = 8                      # quant.CALIBRATION_WINDOWS (LLM's GPTQ now takes 32: quant.LLM_CALIBRATION_WINDOWS)
MAIN_N = (DEFAULT_N, 32)           # the main grid: every source at both sizes
QUICK_SOURCES = ("python-docs", "model-samples")


def spec(method: str, bits: int, calibration: str = "none", n_windows: int = 0, variant: str = "default",
         part: str = "main", **kwargs) -> dict:
    """One model to build: quantize_model(method, bits, group 128, **kwargs) on n_windows of
    `calibration` (gptq / awq), or "rtn" (int4 g128, no calibration), or "fp32". part: "main"
    (the per-source comparison the summary judges) or "ablation"."""
    return dict(method=method, bits=bits, calibration=calibration, n_windows=n_windows, variant=variant,
                part=part, kwargs=kwargs)


def config_key(s: dict) -> str:
    if s["method"] == "fp32":
        return "fp32"
    if s["method"] == "rtn":
        return f"rtn-{s['bits']}bit"
    tail = "" if s["variant"] == "default" else f"-{s['variant']}"
    return f"{s['method']}-{s['bits']}bit-{s['calibration']}-n{s['n_windows']}{tail}"


def grid(quick: bool) -> list[dict]:
    from minillm.quant import CALIBRATION_SOURCES

    if quick:
        # a smoke test of the pipeline (under 2 minutes): 4 bits, two sources, 2 windows of 128
        # tokens, a coarse AWQ grid. Its numbers are noise; only the full run says anything.
        return ([spec("fp32", 32), spec("rtn", 4)]
                + [spec(m, 4, src, 2, **({"n_grid": 4} if m == "awq" else {}))
                   for src in QUICK_SOURCES for m in ("gptq", "awq")])
    specs = [spec("fp32", 32)] + [spec("rtn", bits) for bits in (4, 3)]
    for n in MAIN_N:
        specs += [spec(m, bits, src, n) for bits in (4, 3) for src in CALIBRATION_SOURCES for m in ("gptq", "awq")]
    for bits in (4, 3):                                          # ablations, on Python's docs
        specs += [spec("gptq", bits, "python-docs", 4, part="ablation"),
                  spec("awq", bits, "python-docs", 4, part="ablation"),
                  spec("gptq", bits, "python-docs", DEFAULT_N, "damp0.1", part="ablation", damp=0.1),
                  spec("gptq", bits, "python-docs", DEFAULT_N, "no-act-order", part="ablation", act_order=False)]
    return specs


def settings(quick: bool) -> dict:
    if quick:
        return dict(eval_windows=1, window=128, calib_window=128, seed=0)
    return dict(eval_windows=8, window=512, calib_window=512, seed=0)


def build(base, s: dict, calibration_ids) -> tuple[torch.nn.Module, float]:
    """A quantised copy of the fp32 base (the pattern of benchmarks/quant.py) and the seconds it took."""
    from minillm.quant import drop_fused_projections, quantize_model

    model = copy.deepcopy(base)
    drop_fused_projections(model)
    if s["method"] == "fp32":
        return model, 0.0
    t0 = time.perf_counter()
    if s["method"] == "rtn":
        quantize_model(model, "int4", bits=s["bits"], group_size=128)
    else:
        quantize_model(model, s["method"], bits=s["bits"], group_size=128, calibration_ids=calibration_ids,
                       **s["kwargs"])
    return model, time.perf_counter() - t0


def measure(llm, model, cfg: dict, domains) -> dict[str, float]:
    """Perplexity of `model` (run by llm) on each domain."""
    from minillm.evaluate import domain_text, perplexity

    llm.model = model
    return {d: perplexity(llm, text=domain_text(d), window=cfg["window"], max_windows=cfg["eval_windows"])
            for d in domains}


def calibration_ids_for(tokenizer, model, s: dict, cfg: dict, memo: dict):
    """quant.calibration_windows for a spec, computed once per (source, n_windows)."""
    from minillm.quant import calibration_windows

    if s["method"] in ("fp32", "rtn"):
        return None
    key = (s["calibration"], s["n_windows"])
    if key not in memo:
        memo[key] = calibration_windows(tokenizer, s["n_windows"], cfg["calib_window"], source=s["calibration"],
                                        model=model, seed=cfg["seed"])
    return memo[key]


def summarise(rows: list[dict]) -> dict:
    """rows (method, bits, calibration, n_windows, variant, part, domain, ppl) -> per config the ppl
    per domain and its ratio to RTN of the same bits (below 1: better than RTN); per calibration
    source and size (rows of the main part) whether GPTQ and AWQ beat RTN on every domain."""
    ppl, specs = {}, {}
    for r in rows:
        key = config_key(r)
        ppl.setdefault(key, {})[r["domain"]] = r["ppl"]
        specs[key] = r
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    vs_rtn, everywhere = {}, {}
    for key, s in specs.items():
        rtn = ppl.get(f"rtn-{s['bits']}bit")
        if s["method"] in ("fp32", "rtn") or rtn is None:
            continue
        vs_rtn[key] = {d: ppl[key][d] / rtn[d] for d in domains if d in ppl[key] and d in rtn}
        everywhere[key] = len(vs_rtn[key]) == len(domains) and all(v < 1 for v in vs_rtn[key].values())
    by_source = {}
    for key, s in specs.items():
        if key in everywhere and s.get("part", "main") == "main":
            per_n = by_source.setdefault(s["calibration"], {}).setdefault(f"n{s['n_windows']}", {})
            per_n[f"{s['method']}-{s['bits']}bit"] = everywhere[key]
    winners = [f"{src}-{n}" for src, sizes in by_source.items() for n, v in sizes.items() if all(v.values())]
    out = {"domains": domains, "ppl": ppl, "vs_rtn": vs_rtn, "beats_rtn_everywhere_by_config": everywhere,
           "beats_rtn_everywhere": by_source, "calibrations_that_beat_rtn_everywhere": winners}
    if "fp32" in ppl:
        out["ppl_increase_pct"] = {key: {d: 100 * (v / ppl["fp32"][d] - 1) for d, v in per.items() if d in ppl["fp32"]}
                                   for key, per in ppl.items()}
    return out


def run(quick: bool, partial_path=None, specs: list[dict] | None = None, resume: bool = False) -> dict:
    """partial_path: rewrite the JSON document there after every model (a long run can be
    inspected while it runs). resume: first take the rows of the document already at partial_path
    for every config it measured with the same settings (an interrupted run goes on where it
    stopped; config.resumed lists them). specs: the models to build (default grid(quick))."""
    from minillm.evaluate import DOMAINS
    from minillm.llm import LLM

    quick = quick or common.quick_mode()
    cfg = settings(quick)
    specs = grid(quick) if specs is None else specs
    config = _config(cfg, quick, specs)
    done = _previous_rows(partial_path, config) if resume else {}
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base, tokenizer = llm.model, llm.get_tokenizer()
    memo, rows = {}, []
    for s in specs:
        key = config_key(s)
        if key in done:
            rows += [dict(r, part=s["part"]) for r in done[key]]
            config["resumed"].append(key)
            continue
        t0 = time.perf_counter()
        ids = calibration_ids_for(tokenizer, base, s, cfg, memo)
        calib_s = time.perf_counter() - t0
        model, quant_s = build(base, s, ids)
        for domain, ppl in measure(llm, model, cfg, DOMAINS).items():
            rows.append({**{k: v for k, v in s.items() if k != "kwargs"}, "config": key, "domain": domain,
                         "ppl": ppl, "quantize_s": quant_s, "calibration_s": calib_s})
        llm.model = base
        del model
        print(common.format_table([r for r in rows if r["config"] == key], ["config", "domain", "ppl", "quantize_s"]),
              flush=True)
        if partial_path:
            common.write_json(common.document(NAME, config, rows, summarise(rows)), partial_path)
    return common.document(NAME, config, rows, summarise(rows))


SETTINGS_KEYS = ("model", "domains", "eval", "calibration", "quantized", "quick", "eval_windows", "window",
                 "calib_window", "seed")


def _previous_rows(path, config: dict) -> dict[str, list[dict]]:
    """config key -> its rows (one per domain) in the document at path, if measured with the same settings."""
    import json
    from pathlib import Path

    if not path or not Path(path).is_file():
        return {}
    old = json.loads(Path(path).read_text())
    if any(old.get("config", {}).get(k) != config[k] for k in SETTINGS_KEYS):
        return {}
    by_key = {}
    for r in old.get("results", []):
        by_key.setdefault(r["config"], []).append(r)
    return {k: v for k, v in by_key.items() if sorted(r["domain"] for r in v) == sorted(config["domains"])}


def _config(cfg: dict, quick: bool, specs: list[dict]) -> dict:
    from minillm.evaluate import DOMAINS
    from minillm.quant import SAMPLE_TEMPERATURE, SAMPLE_TOP_P

    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32: the baseline)",
            "domains": list(DOMAINS),
            "eval": f"evaluate.domain_text(domain), at most {cfg['eval_windows']} windows of {cfg['window']} tokens",
            "calibration": f"quant.calibration_windows(source=...), windows of {cfg['calib_window']} tokens; "
                           f"model-samples: BOS then temperature {SAMPLE_TEMPERATURE}, top_p {SAMPLE_TOP_P}, "
                           f"seed {cfg['seed']}",
            "quantized": "linear layers of the 30 blocks, asymmetric, group 128; tied embedding / LM head fp32",
            "gptq": "act-order, blocksize 128, damp 0.01 unless the variant says otherwise, true-sequential",
            "awq": "alpha grid 0..0.95 step 0.05 (quick: 4 steps), clip search 10 steps",
            "configs": [config_key(s) for s in specs], "resumed": [], "quick": quick, **cfg}
