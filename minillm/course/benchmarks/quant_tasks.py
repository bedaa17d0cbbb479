"""Quantisation quality beyond perplexity: task accuracy of SmolLM2 under each weight quantiser.

    python -m minillm bench quant-tasks [--quick] [--json results/quant-tasks.json]

The article's pitfall 2: a quantised model can keep its perplexity (or a generic benchmark) and still
lose on maths, code or long-context retrieval. This benchmark scores the same models as `bench quant`
(fp32 = SmolLM2's Q4_1 GGUF dequantised, int8, int4 RTN g128, NF4, GPTQ and AWQ 4-bit g128, built by
quant.build with the same 4 x 512 calibration windows, so the perplexities equal results/quant-amd.json's
up to the machine's float summation order) on four task-level metrics and on perplexity in the same run:

    facts-mc      multiple choice by log-likelihood: items of 6 families written for this repo
                  (capitals, antonyms, categories, languages, chemical symbols, past tenses;
                  minillm/data/quant_tasks.toml: 210 pairs; a full run scores the first 20 of each
                  family, 120 items, to fit a shared 2-core CPU), the right answer against 3 distractors drawn (seeded)
                  from the same family's answers. Chance: 25%. Also the mean log-likelihood margin
                  (right answer minus best distractor), which moves before the accuracy does.
    facts-greedy  the same prompts after two solved examples of the family (2-shot, so that the format
                  is clear: zero-shot, a 135M model often answers "The capital of Peru is the capital
                  of..."), greedy decoding (LLM.generate, temperature 0): right when the text starts
                  with the answer as a whole word. A choice over the whole vocabulary.
    code-line     exact match of one held-out Python line, greedy: generated class definitions
                  (__init__ assignments, a getter, a to_dict entry) where the line follows from the
                  code above it. The prompt ends before the line's newline (the tokenizer merges a
                  newline with the next line's indentation, so a prompt ending in a bare newline token
                  is out of distribution); right when the output is that newline, the line, then a
                  newline (or end of sequence).
    needle        retrieval in a ~1.07K-token prompt: 4 named 5-digit keys planted at random lines of
                  licence text (minillm/data), then the question for one of them; right when the
                  greedy answer's first number is that key.

Every item is generated deterministically (seeded random.Random), so every machine scores the same set.
Scores are per item (right / wrong), so two models can be compared pair by pair: summary.vs_fp counts the
items each model lost and gained against fp32 and gives McNemar's exact p-value (two-sided binomial on the
discordant items). summary.disagreements lists the model pairs whose perplexity order and task-accuracy
order differ. Scoring runs through LLM.generate (prompt_logprobs for the log-likelihoods), so it measures
what the engine runs.
"""
from __future__ import annotations

import math
import random
import re
import time
import tomllib
from pathlib import Path

from . import common

NAME = "quant-tasks"
ITEMS_FILE = Path(__file__).resolve().parents[2] / "data" / "quant_tasks.toml"
KEYS = ("fp32", "int8", "int4-g128", "nf4", "gptq-4bit-g128", "awq-4bit-g128")     # quant.SPECS keys
# Extra rows (add_rows): a quant.SPECS key and the calibration_text() windows it calibrates on, e.g. GPTQ on the
# 32 windows LLM(quantization="gptq") uses (quant.LLM_CALIBRATION_WINDOWS); and weight AND activation quantisation
# (bench quant --part activations): W8A8 plain and with SmoothQuant, FP8 weights, on bench quant's 4 windows
EXTRA = {"gptq-4bit-g128-calib32": ("gptq-4bit-g128", 32), "w8a8": ("w8a8", 4), "w8a8-sq": ("w8a8-sq", 4),
         "fp8": ("fp8", 4)}
TASKS = ("facts-mc", "facts-greedy", "code-line", "needle")
SEED = 0


def settings(quick: bool) -> dict:
    if quick:
        return dict(eval_windows=1, window=128, calib_windows=2, calib_window=128, keys=("fp32", "int4-g128"),
                    facts_per_family=4, code_items=6, needles=2, needle_filler=200)
    return dict(eval_windows=8, window=512, calib_windows=4, calib_window=512, keys=KEYS,
                facts_per_family=20, code_items=48, needles=6, needle_filler=1000)


# ---- item sets ------------------------------------------------------------------------------------

def choice_items(per_family: int | None = None, seed: int = SEED, path: Path = ITEMS_FILE) -> list[dict]:
    """Multiple-choice items: {"task": family, "prompt", "options": [4 strings, each with its leading
    space], "answer": index of the right option, "shots": the two next pairs of the family, solved, as
    "prompt answer." lines for the greedy task}. Distractors: 3 other answers of the same family (never
    the right answer, never the prompt's own word), drawn and shuffled by random.Random((seed, family))."""
    families = tomllib.loads(path.read_text(encoding="utf-8"))
    items = []
    for family, spec in families.items():
        rng = random.Random(f"{seed}-{family}")
        answers = sorted({a for _, a in spec["pairs"]})
        pairs = spec["pairs"]
        for j, (x, answer) in enumerate(pairs[:per_family]):
            shots = "".join(spec["template"].format(x=pairs[(j + d) % len(pairs)][0]) + f" {pairs[(j + d) % len(pairs)][1]}.\n"
                            for d in (1, 2))
            options = rng.sample([a for a in answers if a not in (answer, x)], 3) + [answer]
            rng.shuffle(options)
            items.append({"task": family, "prompt": spec["template"].format(x=x),
                          "options": [" " + o for o in options], "answer": options.index(answer),
                          "shots": shots})
    return items


FIELDS = ("name", "age", "email", "price", "count", "color", "width", "height", "label", "owner", "path", "size",
          "score", "title", "author", "year", "city", "country", "speed", "weight", "level", "status", "date", "value")
CLASSES = ("User", "Product", "Order", "Point", "Book", "Vehicle", "Player", "Account", "Task", "Record", "Item", "Node")


def code_items(n: int, seed: int = SEED) -> list[dict]:
    """Held-out Python lines: {"task", "prompt", "line"}. A class with 3-5 fields and an __init__ that
    stores them; the held-out line is (in turn) the last assignment of __init__, a getter's return, or
    the next entry (not the last) of a to_dict. The prompt stops before the line's newline."""
    rng = random.Random(f"{seed}-code")
    items = []
    for i in range(n):
        cls, fields = rng.choice(CLASSES), rng.sample(FIELDS, rng.randint(3, 5))
        head = f"```python\nclass {cls}:\n    def __init__(self, {', '.join(fields)}):"
        stores = [f"        self.{f} = {f}" for f in fields]
        if i % 3 == 0:
            items.append({"task": "init", "prompt": "\n".join([head, *stores[:-1]]), "line": stores[-1]})
        elif i % 3 == 1:
            f = rng.choice(fields)
            items.append({"task": "getter", "prompt": "\n".join([head, *stores, "", f"    def get_{f}(self):"]),
                          "line": f"        return self.{f}"})
        else:
            k = rng.randint(1, len(fields) - 2)
            entries = [f'            "{f}": self.{f},' for f in fields]
            items.append({"task": "to_dict", "line": entries[k],
                          "prompt": "\n".join([head, *stores, "", "    def to_dict(self):", "        return {",
                                               *entries[:k]])})
    return items


NEEDLE_NAMES = ("Anna", "Boris", "Chen", "Dara", "Elif", "Femi", "Goran", "Hana", "Ines", "Jonas", "Kofi", "Lena")


def needle_items(tokenizer, n: int, filler_tokens: int, seed: int = SEED, keys_per_prompt: int = 4) -> list[dict]:
    """{"task": "needle", "prompt", "key"}: `filler_tokens` tokens of licence text (evaluate.domain_text,
    from a seeded offset, cut to whole lines) with `keys_per_prompt` lines "The secret number of NAME is
    NNNNN." inserted at random lines; the prompt ends with the question for one of them (seeded), as a
    sentence for the model to complete."""
    from minillm.evaluate import domain_text

    text_ids = tokenizer.encode("\n\n".join(domain_text(d) for d in ("gpl-3", "apache-mpl", "vim-charity")))
    rng = random.Random(f"{seed}-needle")
    items = []
    for _ in range(n):
        start = rng.randrange(0, len(text_ids) - filler_tokens)
        lines = tokenizer.decode(text_ids[start:start + filler_tokens]).split("\n")[1:-1]   # whole lines only
        names = rng.sample(NEEDLE_NAMES, keys_per_prompt)
        keys = [str(rng.randint(10000, 99999)) for _ in names]
        for at, name, key in sorted(zip(rng.sample(range(len(lines) + 1), keys_per_prompt), names, keys), reverse=True):
            lines.insert(at, f"The secret number of {name} is {key}.")
        ask = rng.randrange(keys_per_prompt)
        items.append({"task": "needle", "key": keys[ask],
                      "prompt": "\n".join(lines) + f"\n\nWhat is the secret number of {names[ask]}? "
                                                   f"The secret number of {names[ask]} is"})
    return items


# ---- scorers (pure functions, checked by tests/quant/test_quant_tasks.py) -------------------------------

def choice_correct(option_logprobs: list[float], answer: int) -> bool:
    """Right when the answer's summed log-likelihood is strictly the highest (a tie is wrong)."""
    best = max(option_logprobs)
    return option_logprobs[answer] == best and option_logprobs.count(best) == 1


def choice_margin(option_logprobs: list[float], answer: int) -> float:
    """The answer's log-likelihood minus the best distractor's (> 0 exactly when choice_correct)."""
    return option_logprobs[answer] - max(lp for i, lp in enumerate(option_logprobs) if i != answer)


def word_match(text: str, answer: str) -> bool:
    """The generated text, after leading spaces, starts with `answer` as a whole word."""
    text = text.lstrip(" ")
    return text.startswith(answer) and not text[len(answer):len(answer) + 1].isalnum()


def line_match(text: str, line: str, finish_reason: str | None) -> bool:
    """The output is a newline, exactly `line`, then a newline, or the sequence ended ("stop") right
    after it. Running out of max_tokens right after the line is not a match: the line might go on."""
    if not text.startswith("\n" + line):
        return False
    rest = text[len(line) + 1:]
    return rest.startswith("\n") or (rest == "" and finish_reason == "stop")


def number_match(text: str, key: str) -> bool:
    """The first number in the text (a run of digits) is `key`."""
    found = re.search(r"\d+", text)
    return found is not None and found.group() == key


def option_token_spans(tokenizer, prompt: str, options: list[str]) -> list[tuple[list[int], int]]:
    """Per option: the token ids of prompt + option and where the option's tokens start (the length of
    the prompt's own tokenization, which must be a prefix of the joined one)."""
    head = tokenizer.encode(prompt)
    spans = []
    for option in options:
        ids = tokenizer.encode(prompt + option)
        if ids[:len(head)] != head or len(ids) == len(head):
            raise ValueError(f"option {option!r} does not tokenize as a continuation of {prompt!r}")
        spans.append((ids, len(head)))
    return spans


def mcnemar_p(lost: int, gained: int) -> float:
    """Two-sided exact McNemar test: P(a split at least this uneven) for lost + gained discordant items
    under "either model is as likely to win an item" (binomial, p = 1/2). 1.0 when there are none."""
    n = lost + gained
    if n == 0:
        return 1.0
    k = min(lost, gained)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


# ---- scoring a model -------------------------------------------------------------------------------

def score_choice(llm, items: list[dict]) -> tuple[list[bool], list[float]]:
    """Per item: right or wrong, and the margin; every (prompt + option) is one prompt of one
    LLM.generate call with prompt_logprobs=0 (the log-probability of each actual token)."""
    from minillm.engine.sampling import SamplingParams

    tokenizer = llm.get_tokenizer()
    requests, where = [], []
    for i, item in enumerate(items):
        for ids, start in option_token_spans(tokenizer, item["prompt"], item["options"]):
            requests.append({"prompt_token_ids": ids})
            where.append((i, start))
    outs = llm.generate(requests, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    logprobs = [[] for _ in items]
    for (i, start), request, out in zip(where, requests, outs):
        ids = request["prompt_token_ids"]
        logprobs[i].append(sum(out.prompt_logprobs[t][ids[t]].logprob for t in range(start, len(ids))))
    return ([choice_correct(lp, it["answer"]) for lp, it in zip(logprobs, items)],
            [choice_margin(lp, it["answer"]) for lp, it in zip(logprobs, items)])


def score_greedy(llm, prompts: list[str], max_tokens: int) -> list[tuple[str, str | None]]:
    """(text, finish_reason) of each prompt's greedy continuation, all prompts in one LLM.generate."""
    from minillm.engine.sampling import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [(o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def score_model(llm, items: dict) -> dict:
    """Per-item right/wrong lists of every task (and the facts-mc margins), for the model llm runs now."""
    facts, code, needles = items["facts"], items["code"], items["needle"]
    mc, margins = score_choice(llm, facts)
    greedy = score_greedy(llm, [it["shots"] + it["prompt"] for it in facts], max_tokens=6)
    code_out = score_greedy(llm, [it["prompt"] for it in code], max_tokens=24)
    needle_out = score_greedy(llm, [it["prompt"] for it in needles], max_tokens=8)
    answers = [it["options"][it["answer"]].lstrip() for it in facts]
    return {"facts-mc": mc, "facts-mc-margin": margins,
            "facts-greedy": [word_match(t, a) for (t, _), a in zip(greedy, answers)],
            "code-line": [line_match(t, it["line"], f) for (t, f), it in zip(code_out, code)],
            "needle": [number_match(t, it["key"]) for (t, _), it in zip(needle_out, needles)]}


# ---- the benchmark ---------------------------------------------------------------------------------

def build_items(tokenizer, cfg: dict) -> dict:
    return {"facts": choice_items(cfg["facts_per_family"]), "code": code_items(cfg["code_items"]),
            "needle": needle_items(tokenizer, cfg["needles"], cfg["needle_filler"])}


def accuracy(flags: list[bool]) -> float:
    return 100 * sum(flags) / len(flags)


def summarise(rows: list[dict], scores: dict) -> dict:
    """Against fp32: perplexity change, accuracy change, items lost / gained, McNemar p per task; the
    model pairs on which perplexity and a task disagree (lower perplexity, lower accuracy)."""
    base = next(r for r in rows if r["method"] == "fp32")
    vs_fp = {}
    for r in rows:
        if r["method"] == "fp32":
            continue
        entry = {"ppl_increase_pct": 100 * (r["ppl"] / base["ppl"] - 1)}
        for task in TASKS:
            pairs = list(zip(scores["fp32"][task], scores[r["method"]][task]))
            lost = sum(a and not b for a, b in pairs)
            gained = sum(b and not a for a, b in pairs)
            entry[task] = {"acc_change_pp": r[f"{task}_acc"] - base[f"{task}_acc"], "lost": lost, "gained": gained,
                           "mcnemar_p": mcnemar_p(lost, gained)}
        entry["facts-mc-margin_change"] = r["facts-mc_margin"] - base["facts-mc_margin"]
        vs_fp[r["method"]] = entry
    disagreements = []
    for a in rows:
        for b in rows:
            if a["ppl"] >= b["ppl"]:
                continue                                                 # a: the lower perplexity
            for task in TASKS:
                if a[f"{task}_acc"] < b[f"{task}_acc"]:
                    pairs = list(zip(scores[a["method"]][task], scores[b["method"]][task]))
                    lost = sum(x and not y for x, y in pairs)
                    gained = sum(y and not x for x, y in pairs)
                    disagreements.append({"lower_ppl": a["method"], "higher_acc": b["method"], "task": task,
                                          "ppl": [a["ppl"], b["ppl"]], "acc": [a[f"{task}_acc"], b[f"{task}_acc"]],
                                          "items_only_lower_ppl_right": lost, "items_only_higher_acc_right": gained,
                                          "mcnemar_p": mcnemar_p(lost, gained)})
    order = lambda key, reverse: [r["method"] for r in sorted(rows, key=lambda r: r[key], reverse=reverse)]  # noqa: E731
    return {"vs_fp": vs_fp, "disagreements": disagreements,
            "order_by_ppl": order("ppl", False),
            "order_by_task": {task: order(f"{task}_acc", True) for task in TASKS},
            "items": {task: len(scores["fp32"][task]) for task in TASKS}}


def run(quick: bool, json_path: str | None = None) -> dict:
    """json_path (the CLI's --json): the document is rewritten there after every model, so that a long run
    can be inspected or salvaged while it is still going (summary.complete says whether it finished)."""
    from minillm.llm import LLM
    from minillm.quant import calibration_windows
    from .quant import build, measure

    cfg = settings(quick)
    t_start = time.perf_counter()
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base = llm.model
    tokenizer = llm.get_tokenizer()
    items = build_items(tokenizer, cfg)
    calibration_ids = calibration_windows(tokenizer, cfg["calib_windows"], cfg["calib_window"])
    rows, scores = [], {}
    for key in cfg["keys"]:
        model, quant_s = build(base, key, calibration_ids)
        t0 = time.perf_counter()
        row = {"method": key, **measure(llm, model, cfg)}                  # sets llm.model = model
        per_item = score_model(llm, items)
        scores[key] = per_item
        for task in TASKS:
            row[f"{task}_acc"] = accuracy(per_item[task])
        margins = per_item["facts-mc-margin"]
        row["facts-mc_margin"] = sum(margins) / len(margins)
        row["quantize_s"], row["score_s"] = quant_s, time.perf_counter() - t0
        rows.append(row)
        print(common.format_table([row]), flush=True)
        del model
        doc = _document(cfg, quick, items, rows, scores, t_start, complete=len(rows) == len(cfg["keys"]))
        if json_path:
            common.write_json(doc, json_path)
    llm.model = base
    return doc


def add_rows(json_path: str, keys=tuple(EXTRA)) -> dict:
    """Score the EXTRA models on the same items and add them to a finished run's document at json_path
    (rewritten; summary.added lists each call's rows, machine and time). Each is quant.build's model of its
    SPECS key, calibrated on its own number of calibration_text() windows."""
    import json

    from minillm.llm import LLM
    from minillm.quant import calibration_windows
    from .quant import build, measure

    doc = json.loads(Path(json_path).read_text())
    cfg = {k: v for k, v in doc["config"].items() if k in settings(False)}
    quick = doc["config"]["quick"]
    t_added = time.perf_counter()
    llm = LLM(model="smollm2", dtype="float32", device="cpu")
    base, tokenizer = llm.model, llm.get_tokenizer()
    items = build_items(tokenizer, cfg)
    rows = doc["results"]
    scores = {k: {t: [bool(x) for x in v[t]] for t in TASKS} for k, v in doc["summary"]["per_item"].items()}
    margins = {r["method"]: r["facts-mc_margin"] for r in rows}
    for key in keys:
        spec_key, windows = EXTRA[key]
        ids = calibration_windows(tokenizer, windows, cfg["calib_window"])
        model, quant_s = build(base, spec_key, ids)
        t0 = time.perf_counter()
        row = {"method": key, **measure(llm, model, cfg)}
        per_item = score_model(llm, items)
        scores[key] = {t: per_item[t] for t in TASKS}
        row.update({f"{t}_acc": accuracy(per_item[t]) for t in TASKS})
        row["facts-mc_margin"] = sum(per_item["facts-mc-margin"]) / len(per_item["facts-mc-margin"])
        row["calib_windows"], row["quantize_s"], row["score_s"] = windows, quant_s, time.perf_counter() - t0
        rows = [r for r in rows if r["method"] != key] + [row]
        margins[key] = row["facts-mc_margin"]
        print(common.format_table([row]), flush=True)
    new = _document(cfg, quick, items, rows, scores, t_added, complete=doc["summary"]["complete"])
    new["machine"] = doc["machine"]
    earlier = doc["summary"].get("added", [])                              # one entry per add_rows call
    new["summary"]["added"] = (earlier if isinstance(earlier, list) else [earlier]) + [
        {"rows": list(keys), "machine": common.machine_info(), "wall_s": new["summary"]["wall_s"]}]
    new["summary"]["wall_s"] = doc["summary"]["wall_s"]                  # the main run's
    common.write_json(new, json_path)
    return new


def _document(cfg, quick, items, rows, scores, t_start, complete: bool) -> dict:
    summary = summarise(rows, scores)
    summary["per_item"] = {key: {task: [int(x) for x in s[task]] for task in TASKS} for key, s in scores.items()}
    summary["per_family_acc"] = {key: _per_family(items, s) for key, s in scores.items()}
    summary["wall_s"], summary["complete"] = time.perf_counter() - t_start, complete
    return common.document(NAME, _config(cfg, quick, items), rows, summary)


def _per_family(items: dict, s: dict) -> dict:
    out = {}
    for task, pool in (("facts-mc", "facts"), ("facts-greedy", "facts"), ("code-line", "code")):
        for family in dict.fromkeys(it["task"] for it in items[pool]):
            flags = [ok for ok, it in zip(s[task], items[pool]) if it["task"] == family]
            out[f"{task}/{family}"] = accuracy(flags)
    return out


def _config(cfg: dict, quick: bool, items: dict) -> dict:
    return {"model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to fp32: the baseline)",
            "models": "quant.build (bench quant's builds): linear layers of the 30 blocks quantised, tied "
                      "embedding / LM head fp32; GPTQ / AWQ calibrated on calibration_text()",
            "ppl": f"evaluation_text(), {cfg['eval_windows']} windows of {cfg['window']} tokens",
            "calibration": f"calibration_text(), {cfg['calib_windows']} windows of {cfg['calib_window']} tokens",
            "facts-mc": f"{len(items['facts'])} items (minillm/data/quant_tasks.toml), 4 options, summed "
                        f"log-likelihood of the option's tokens; chance 25%",
            "facts-greedy": "the same prompts after 2 solved examples of the family, 6 greedy tokens, right when the text starts with the answer word",
            "code-line": f"{len(items['code'])} generated class definitions, 24 greedy tokens, exact line match",
            "needle": f"{len(items['needle'])} prompts of ~{cfg['needle_filler']} filler tokens with 4 named keys, "
                      f"8 greedy tokens, first number = the key",
            "seed": SEED, "quick": quick, **cfg}
