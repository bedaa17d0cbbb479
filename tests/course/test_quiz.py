"""The interview drill: its question bank (minillm/course/quiz_bank.toml) and `python -m minillm quiz`.

The bank must hold every question the lessons quote from the article and every practice problem the
lessons print, point each to a real lesson section, and compute every number it shows; the command
must run without a terminal, in a seeded order, and refuse bad arguments with a clear message."""
import io
import math
import re
import subprocess
import sys
import textwrap

import pytest

from minillm.__main__ import main
from minillm.course.quiz import (KINDS, REPO, REQUIRED, BankError, heading_anchors, lesson_anchors, lesson_path, load_bank,
                                 run, select, shown)

BANK = load_bank()


def test_bank_parses_and_every_entry_points_to_a_lesson_section():
    assert len({q["id"] for q in BANK}) == len(BANK)
    for q in BANK:
        assert all(q.get(field) for field in REQUIRED), q["id"]
        assert q["kind"] in KINDS
        assert q["section"] in lesson_anchors(q["lesson"]), (q["id"], q["section"])


def _normalised(text: str) -> str:
    return re.sub(r"[\"'“”‘’\s]", "", text)


def test_every_chinese_question_the_lessons_ask_is_in_the_bank():
    chinese = _normalised(" ".join(q.get("zh", "") for q in BANK))
    for path in sorted((REPO / "lessons").glob("0*.md")):
        for bold in re.findall(r"\*\*(.+?)\*\*", path.read_text()):
            for question in re.findall(r"[^？]*？", bold.removeprefix("Q: ").strip('"')):
                if re.search(r"[\u4e00-\u9fff]", question):
                    assert _normalised(question) in chinese, f"{path.name}: {question}"


def test_every_practice_problem_of_a_lesson_is_in_the_bank():
    for lesson in range(1, 10):
        text = lesson_path(lesson).read_text()
        practice = text.split("\n## Practice\n", 1)[1].split("\n## ", 1)[0]
        printed = re.findall(r"^\*\*(Q\d+\.\d+) ", practice, flags=re.M)
        assert 4 <= len(printed) <= 6, lesson
        assert printed == [q["id"] for q in BANK if q["kind"] == "practice" and q["lesson"] == lesson]


@pytest.mark.parametrize("question", [q for q in BANK if q.get("numbers")], ids=lambda q: q["id"])
def test_every_number_evaluates(question):
    answer, lines = shown(question)
    assert "{" not in answer and len(lines) == len(question["numbers"])
    for line in lines:
        value = re.search(r": (-?[\d,.]+)", line).group(1).replace(",", "")
        assert math.isfinite(float(value)), line


def ask_nothing(prompt=""):
    return ""


def drill(**kwargs) -> list[str]:
    printed = []
    run(ask=ask_nothing, out=printed.append, **kwargs)
    return printed


def test_quiz_lesson_3_runs_without_a_terminal_and_answers_every_question():
    done = subprocess.run([sys.executable, "-m", "minillm", "quiz", "--lesson", "3", "--seed", "0"], cwd=REPO,
                          input="\n" * 40, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lesson3 = [q for q in BANK if q["lesson"] == 3]
    assert done.stdout.count("Answer: ") == len(lesson3)
    flat = " ".join(done.stdout.split())
    for q in lesson3:
        assert " ".join(q["en"].split())[:60] in flat
        assert " ".join(shown(q)[0].split())[:60] in flat


def test_the_same_seed_gives_the_same_order():
    order = [q["id"] for q in select(BANK, lesson=3, seed=0)]
    assert order == [q["id"] for q in select(BANK, lesson=3, seed=0)]
    assert sorted(order) == sorted(q["id"] for q in BANK if q["lesson"] == 3)
    assert [q["id"] for q in select(BANK)] == [q["id"] for q in BANK]        # no seed: the bank's order
    assert drill(lesson=3, seed=0) == drill(lesson=3, seed=0)


def test_end_of_input_stops_waiting_and_q_quits():
    def closed(prompt=""):
        raise EOFError

    printed = []
    assert run(lesson=1, ask=closed, out=printed.append) == len([q for q in BANK if q["lesson"] == 1])
    assert run(lesson=1, ask=lambda prompt="": "q", out=printed.append) == 0


def test_every_question_and_answer_is_in_chinese_too_with_the_same_numbers():
    for q in BANK:
        assert re.search(r"[\u4e00-\u9fff]", q.get("zh", "")), f"{q['id']} has no Chinese question"
        assert re.search(r"[\u4e00-\u9fff]", q.get("answer_zh", "")), f"{q['id']} has no Chinese answer"
        names = lambda text: sorted(re.findall(r"\{(\w+)\}", text))  # noqa: E731
        assert names(q["answer_zh"]) == names(q["answer"]), q["id"]
        for n in q.get("numbers", []):
            assert re.search(r"[\u4e00-\u9fff]", n.get("label_zh", "")), f"{q['id']}: {n['name']} has no label_zh"


def test_quiz_in_chinese_asks_answers_and_points_to_the_chinese_lesson():
    done = subprocess.run([sys.executable, "-m", "minillm", "quiz", "--lang", "zh", "--lesson", "2", "--seed", "0"],
                          cwd=REPO, input="\n" * 40, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lesson2 = [q for q in BANK if q["lesson"] == 2]
    assert done.stdout.count("答案：") == len(lesson2) and "Answer:" not in done.stdout
    flat = "".join(done.stdout.split())
    zh_anchors = set(heading_anchors(REPO / "lessons" / "zh" / lesson_path(2).name))
    for q in lesson2:
        assert "".join(q["zh"].split())[:40] in flat
        assert "".join(shown(q, "zh")[0].split())[:40] in flat
    links = re.findall(r"延伸阅读：lessons/zh/02-kv-cache\.md#(\S+)", done.stdout)
    assert len(links) == len(lesson2) and set(links) <= zh_anchors


def test_the_chinese_lessons_print_the_same_practice_problems_as_the_bank():
    for lesson in range(1, 10):
        text = (REPO / "lessons" / "zh" / lesson_path(lesson).name).read_text()
        practice = text.split("\n## 练习\n", 1)[1].split("\n## ", 1)[0]
        printed = re.findall(r"^\*\*(Q\d+\.\d+) ", practice, flags=re.M)
        assert printed == [q["id"] for q in BANK if q["kind"] == "practice" and q["lesson"] == lesson]


def test_a_question_without_chinese_is_refused_in_chinese_with_what_is_allowed(tmp_path):
    with pytest.raises(BankError, match=re.escape("question 'broken' has no zh or answer_zh; allowed: --lang en")):
        run(bank=write_bank(tmp_path, ENTRY), lang="zh", ask=ask_nothing, out=lambda s: None)


def test_bad_lesson_and_bad_language_are_refused_with_what_is_allowed(capsys):
    assert main(["quiz", "--lesson", "42"]) == 2
    assert "lesson 42 has no questions; allowed: --lesson 1, 2" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quiz", "--lang", "fr"])
    assert "invalid choice: 'fr'" in capsys.readouterr().err


def write_bank(tmp_path, body: str):
    path = tmp_path / "bank.toml"
    path.write_text(textwrap.dedent(body))
    return path


ENTRY = """
    [[question]]
    id = "broken"
    lesson = 1
    section = "practice"
    kind = "practice"
    en = "A question?"
    answer = "It is {x}."
    [[question.numbers]]
    name = "x"
    module = "minillm.perf.roofline"
    expr = 'ridge_point("H900")'
    """


def test_a_failing_expression_names_the_question_and_the_expression(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))
    assert main(["quiz", "--bank", str(write_bank(tmp_path, ENTRY))]) == 2
    err = capsys.readouterr().err
    assert "question 'broken': number 'x'" in err and 'ridge_point("H900")' in err and "KeyError" in err


@pytest.mark.parametrize("change, message", [
    (('kind = "practice"', 'kind = "homework"'), "allowed: article, pitfall, lesson, practice"),
    (('section = "practice"', 'section = "nowhere"'), "#nowhere, which is not a section of"),
    (('en = "A question?"\n', ""), "lacks en; required"),
    (("It is {x}.", "It is {y}."), "uses {y} but its numbers are ['x']"),
    (('module = "minillm.perf.roofline"\n', ""), "exactly one of module (counted) or results (measured)"),
    (("lesson = 1", "lesson = 42"), "lesson 42 has no file"),
])
def test_a_malformed_entry_is_refused_with_what_is_allowed(tmp_path, change, message):
    with pytest.raises(BankError, match=re.escape(message)):
        load_bank(write_bank(tmp_path, ENTRY.replace(*change)))


def test_the_drill_imports_torch_only_for_a_counted_number(tmp_path):
    measured = ENTRY.replace('module = "minillm.perf.roofline"', 'results = "results/roofline.json"').replace(
        'ridge_point("H900")', "summary.bandwidth_bound_tok_s_float32")
    code = (f"import sys; from minillm.course.quiz import load_bank, run; load_bank(); "
            f"run(bank={str(write_bank(tmp_path, measured))!r}, ask=lambda p='': '', out=lambda s: None); "
            f"assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
