"""`python -m minillm bench quant-tasks` (lesson 04, task accuracy): its scorers against hand-computed
cases, its item sets, and its log-likelihood scoring against a plain forward of a tiny random model."""
import math

import pytest
import torch

from minillm import LLM
from minillm.course.benchmarks import quant_tasks as qt
from minillm.model.llama import random_model, tiny_config


class ByteTokenizer:
    """One id per UTF-8 byte (vocab 256 = tiny_config's); id 2 (a control byte no text here has) is EOS."""
    eos_token_id = 2

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if not (skip_special_tokens and i == self.eos_token_id)).decode("utf-8", "replace")


@pytest.fixture(scope="module")
def tiny_llm():
    return LLM(model=random_model(tiny_config(), seed=0), tokenizer=ByteTokenizer(), device="cpu", max_model_len=512)


# ---- scorers: hand-computed cases -----------------------------------------------------------------

def test_choice_correct_and_margin():
    assert qt.choice_correct([-3.0, -1.0, -2.0, -5.0], 1)
    assert not qt.choice_correct([-3.0, -1.0, -2.0, -5.0], 2)
    assert not qt.choice_correct([-1.0, -1.0, -2.0, -5.0], 0)            # a tie is wrong
    assert qt.choice_margin([-3.0, -1.0, -2.0, -5.0], 1) == 1.0          # -1 - (-2)
    assert qt.choice_margin([-3.0, -1.0, -2.0, -5.0], 3) == -4.0         # -5 - (-1)


@pytest.mark.parametrize("text, answer, right", [
    (" Paris.\nThe", "Paris", True), ("Paris", "Paris", True), (" Parisian", "Paris", False),
    (" the capital", "Paris", False), (" Mexico City.", "Mexico City", True), (" Au", "Au", True),
    (" Aug", "Au", False), (" C.", "C", True), (" Cl", "C", False)])
def test_word_match(text, answer, right):
    assert qt.word_match(text, answer) is right


@pytest.mark.parametrize("text, finish, right", [
    ("\n        self.x = x\n    def", "length", True),
    ("\n        self.x = x", "stop", True),                   # EOS right after the line
    ("\n        self.x = x", "length", False),                # cut by max_tokens: the line might go on
    ("\n        self.x = x.y\n", "length", False),
    ("        self.x = x\n", "length", False),                # no newline first
    ("\n    self.x = x\n", "length", False)])                 # wrong indentation
def test_line_match(text, finish, right):
    assert qt.line_match(text, "        self.x = x", finish) is right


@pytest.mark.parametrize("text, right", [(" 48213.", True), (" 4821", False), (" 482134", False),
                                         (" number 48213", True), (" unknown", False), (" 1, then 48213", False)])
def test_number_match(text, right):
    assert qt.number_match(text, "48213") is right


def test_mcnemar_p_is_the_two_sided_binomial_tail():
    assert qt.mcnemar_p(0, 0) == 1.0
    assert qt.mcnemar_p(0, 5) == 2 / 32                                  # 2 * P(X <= 0), X ~ Bin(5, 1/2)
    assert qt.mcnemar_p(8, 2) == pytest.approx(2 * (1 + 10 + 45) / 1024)
    assert qt.mcnemar_p(3, 3) == 1.0


def test_summarise_counts_lost_and_gained_items_and_flags_disagreements():
    rows = [{"method": "fp32", "ppl": 10.0}, {"method": "a", "ppl": 11.0}, {"method": "b", "ppl": 12.0}]
    per = {"fp32": [1, 1, 1, 0], "a": [1, 0, 0, 0], "b": [1, 1, 0, 1]}          # the same flags for every task
    scores = {k: {t: [bool(x) for x in v] for t in qt.TASKS} for k, v in per.items()}
    for r in rows:
        r.update({f"{t}_acc": qt.accuracy(scores[r["method"]][t]) for t in qt.TASKS}, **{"facts-mc_margin": 0.0})
    s = qt.summarise(rows, scores)
    assert s["vs_fp"]["a"]["code-line"] == {"acc_change_pp": -50.0, "lost": 2, "gained": 0, "mcnemar_p": 0.5}
    assert s["vs_fp"]["b"]["needle"]["lost"] == 1 and s["vs_fp"]["b"]["needle"]["gained"] == 1
    assert s["vs_fp"]["a"]["ppl_increase_pct"] == pytest.approx(10.0)
    # a has the lower perplexity than b but the lower accuracy (25% against 75%), on every task
    found = {(d["lower_ppl"], d["higher_acc"]) for d in s["disagreements"]}
    assert found == {("a", "b")}
    d = s["disagreements"][0]
    assert (d["items_only_lower_ppl_right"], d["items_only_higher_acc_right"]) == (0, 2)
    assert s["order_by_ppl"] == ["fp32", "a", "b"] and s["order_by_task"]["needle"] == ["fp32", "b", "a"]


# ---- item sets ------------------------------------------------------------------------------------

def test_choice_items_are_fixed_and_well_formed():
    items = qt.choice_items()
    assert items == qt.choice_items()                                    # seeded: every machine, the same
    assert len(items) == 210 and len({it["task"] for it in items}) == 6
    for it in items:
        assert len(set(it["options"])) == 4 and all(o.startswith(" ") for o in it["options"])
        assert it["shots"].count("\n") == 2 and it["prompt"] not in it["shots"]
    assert {"prompt": "The capital of France is", "answer": " Paris"} in [
        {"prompt": it["prompt"], "answer": it["options"][it["answer"]]} for it in items]


def test_code_items_hold_out_a_line_that_follows_from_the_prompt():
    items = qt.code_items(12)
    assert [it["task"] for it in items[:3]] == ["init", "getter", "to_dict"]
    for it in items:
        assert not it["prompt"].endswith("\n") and it["line"] not in it["prompt"].split("\n")
        field = it["line"].split("self.")[-1].split()[0].strip(",")
        assert f"self.{field} = {field}" in it["prompt"] or f"{field}):" in it["prompt"]


def test_needle_items_plant_four_keys_and_ask_for_one():
    items = qt.needle_items(ByteTokenizer(), 3, filler_tokens=600)
    assert items == qt.needle_items(ByteTokenizer(), 3, filler_tokens=600)
    for it in items:
        planted = [line for line in it["prompt"].split("\n") if line.startswith("The secret number of ")]
        assert len(planted) == 4 and sum(it["key"] in line for line in planted) == 1
        name = it["prompt"].rsplit("The secret number of ", 1)[1].removesuffix(" is")
        assert f"The secret number of {name} is {it['key']}." in planted


# ---- scoring a (tiny, random) model -----------------------------------------------------------------

def test_choice_scores_equal_a_plain_forward(tiny_llm):
    items = [{"task": "t", "prompt": "ab", "options": [" c", " dd", " e", " fgh"], "answer": 1},
             {"task": "t", "prompt": "xyz", "options": [" 1", " 2", " 3", " 4"], "answer": 3}]
    right, margins = qt.score_choice(tiny_llm, items)
    tok = ByteTokenizer()
    for item, ok, margin in zip(items, right, margins):
        lps = []
        for option in item["options"]:
            ids = tok.encode(item["prompt"] + option)
            with torch.no_grad():
                logp = torch.log_softmax(tiny_llm.model(torch.tensor([ids]))[0].double(), -1)
            start = len(tok.encode(item["prompt"]))
            lps.append(sum(logp[t - 1, ids[t]].item() for t in range(start, len(ids))))
        assert margin == pytest.approx(qt.choice_margin(lps, item["answer"]), abs=1e-3)
        assert ok == (max(range(4), key=lps.__getitem__) == item["answer"])


def test_score_model_scores_every_item_of_every_task(tiny_llm):
    items = {"facts": qt.choice_items(per_family=1), "code": qt.code_items(3),
             "needle": qt.needle_items(ByteTokenizer(), 1, filler_tokens=150)}
    scores = qt.score_model(tiny_llm, items)
    assert [len(scores[t]) for t in qt.TASKS] == [6, 6, 3, 1]
    assert all(isinstance(x, bool) for t in qt.TASKS for x in scores[t])
    assert all(math.isfinite(m) for m in scores["facts-mc-margin"])
