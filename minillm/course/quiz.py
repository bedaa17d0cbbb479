"""Interview drill: `python -m minillm quiz [--lesson N] [--seed S] [--lang en|zh]`.

The questions live in one data file, minillm/course/quiz_bank.toml: every interview question of the source
article and its pitfalls, the questions the lessons add, and every lesson's practice problems, each in
English and Chinese (`zh`, `answer_zh`; `--lang zh` asks and answers in Chinese and points to the Chinese
lesson, lessons/zh/, whose sections run parallel to the English ones). Each has a short answer, the lesson
section that answers it in full, and, for numeric answers, the expression behind each number. The
expressions are evaluated when the answer is shown, so an answer cannot go stale:

    counted   module + expr    a Python expression in a module of this package (the same expressions
                               as the lessons' footnotes: `counted by minillm.X: expr`)
    measured  results + expr   an expression over one results/*.json file of this machine's benchmarks,
                               in the number guard's syntax (tests/prose_numbers.py): summary.ppl,
                               results(dtype="bfloat16").bound_tok_s, results.all(part="x")

This module imports nothing heavy; a counted number imports its module (often torch) when it is shown.
"""
from __future__ import annotations

import random
import re
import textwrap
import tomllib
from pathlib import Path

from . import results_view

REPO = Path(__file__).resolve().parents[2]
BANK = Path(__file__).resolve().parent / "quiz_bank.toml"
KINDS = ("article", "pitfall", "lesson", "practice")    # the article's questions, its 陷阱, a lesson's own, drills
REQUIRED = ("id", "lesson", "section", "kind", "en", "answer")
WORDS = {"en": {"answer": "Answer: ", "more": "Read more: ", "wait": "  (Enter: the answer, q and Enter: quit)",
                "lesson": "lesson {n:02d}", "kind": "{kind} question"},
         "zh": {"answer": "答案：", "more": "延伸阅读：", "wait": "  （回车看答案，输入 q 回车退出）",
                "lesson": "第 {n:02d} 课", "kind": "{kind}"}}
KIND_ZH = {"article": "原文面试题", "pitfall": "原文陷阱", "lesson": "课程追问", "practice": "练习"}


class BankError(ValueError):
    """A question bank entry that is malformed, or whose number cannot be computed."""


# ---------------------------------------------------------------------------------------- the bank

def load_bank(path: Path | str = BANK) -> list[dict]:
    """The questions of a bank file, in file order, each checked (BankError names what is wrong)."""
    path = Path(path)
    try:
        questions = tomllib.loads(path.read_text()).get("question", [])
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise BankError(f"cannot read the question bank {path}: {e}") from None
    seen = set()
    for q in questions:
        check_question(q)
        if q["id"] in seen:
            raise BankError(f"question {q['id']!r} appears twice in {path}; allowed: unique ids")
        seen.add(q["id"])
    return questions


def check_question(q: dict) -> None:
    where = f"question {q.get('id', '(no id)')!r}"
    missing = [f for f in REQUIRED if f not in q]
    if missing:
        raise BankError(f"{where} lacks {', '.join(missing)}; required: {', '.join(REQUIRED)}")
    if q["kind"] not in KINDS:
        raise BankError(f"{where} has kind {q['kind']!r}; allowed: {', '.join(KINDS)}")
    if q["section"] not in lesson_anchors(q["lesson"]):
        raise BankError(f"{where} points to #{q['section']}, which is not a section of {lesson_path(q['lesson'])}; "
                        f"allowed: {', '.join(sorted(lesson_anchors(q['lesson'])))}")
    names = set()
    for n in q.get("numbers", []):
        if "name" not in n or "expr" not in n or ("module" in n) == ("results" in n):
            raise BankError(f"{where}: a number needs name, expr and exactly one of module (counted) or results "
                            f"(measured), got {sorted(n)}")
        names.add(n["name"])
    for field in ("answer", "answer_zh"):
        unknown = set(re.findall(r"\{(\w+)\}", q.get(field, ""))) - names
        if unknown:
            raise BankError(f"{where}'s {field} uses {{{'}, {'.join(sorted(unknown))}}} but its numbers are "
                            f"{sorted(names) or 'none'}; allowed: the names of its [[question.numbers]]")


def lesson_path(lesson: int) -> Path:
    found = sorted((REPO / "lessons").glob(f"{lesson:02d}-*.md")) if isinstance(lesson, int) else []
    if not found:
        raise BankError(f"lesson {lesson!r} has no file lessons/{lesson!r:0>2}-*.md; allowed: {lesson_numbers()}")
    return found[0]


def lesson_numbers() -> list[int]:
    return sorted(int(p.name[:2]) for p in (REPO / "lessons").glob("[0-9][0-9]-*.md"))


def lesson_anchors(lesson: int) -> set[str]:
    """The anchors GitHub gives the lesson's headings (outside code blocks)."""
    return set(heading_anchors(lesson_path(lesson)))


def heading_anchors(path: Path) -> list[str]:
    anchors, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            anchors.append(github_anchor(line.lstrip("#")))
    return anchors


def read_more(q: dict, lang: str) -> str:
    """Where the answer is in full: the English section, or the Chinese twin's section at the same place."""
    path = lesson_path(q["lesson"])
    if lang == "zh":
        zh = path.parent / "zh" / path.name
        if not zh.exists():
            raise BankError(f"lesson {q['lesson']} has no Chinese edition {zh.relative_to(REPO)}; allowed: --lang en")
        anchor = heading_anchors(zh)[heading_anchors(path).index(q["section"])]
        return f"{zh.relative_to(REPO)}#{anchor}"
    return f"{path.relative_to(REPO)}#{q['section']}"


def github_anchor(heading: str) -> str:
    """GitHub's heading slug: lower case, punctuation dropped (letters of any script kept), spaces to '-'.
    Footnote references and code/bold markers are not part of the heading's text."""
    text = re.sub(r"\[\^[^\]]*\]|[`*]", "", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


# ------------------------------------------------------------------------------------- the numbers

def evaluate(number: dict) -> float:
    """The number's value now: its expression in its module's names, or over its results file."""
    if "module" in number:
        return results_view.evaluate(number["expr"], module=number["module"])
    return results_view.evaluate(number["expr"], results=REPO / number["results"])


def source(number: dict) -> str:
    if "module" in number:
        return f"counted by {number['module']}: {number['expr']}"
    return f"measured in {number['results']}: {number['expr']}"


def shown(q: dict, lang: str = "en") -> tuple[str, list[str]]:
    """The answer with its numbers filled in, and one line per number saying where it comes from."""
    values, lines = {}, []
    label = "label_zh" if lang == "zh" else "label"
    for n in q.get("numbers", []):
        try:
            value = evaluate(n)
        except Exception as e:  # noqa: BLE001 (any failure is the bank's: say which entry and why)
            raise BankError(f"question {q['id']!r}: number {n['name']!r} = {source(n)} failed: "
                            f"{type(e).__name__}: {e}; fix the expression in the question bank") from None
        unit = n.get("unit", "")
        text = f"{value:{n.get('fmt', ',.4g')}}" + (unit if unit in ("%", "x") else f" {unit}" if unit else "")
        values[n["name"]] = text
        lines.append(f"{n.get(label, n.get('label', n['name']))}: {text}  ({source(n)})")
    answer = re.sub(r"\{(\w+)\}", lambda m: values[m.group(1)], q["answer_zh" if lang == "zh" else "answer"])
    return answer, lines


# ---------------------------------------------------------------------------------------- the drill

def select(bank: list[dict], lesson: int | None = None, seed: int | None = None) -> list[dict]:
    """All questions (or one lesson's) in bank order, or shuffled by seed: the same seed, the same order."""
    if lesson is not None:
        have = sorted({q["lesson"] for q in bank})
        if lesson not in have:
            raise BankError(f"lesson {lesson} has no questions; allowed: --lesson {', '.join(map(str, have))}")
        bank = [q for q in bank if q["lesson"] == lesson]
    bank = list(bank)
    if seed is not None:
        random.Random(seed).shuffle(bank)
    return bank


def question_text(q: dict, lang: str) -> str:
    if lang == "zh":
        missing = [f for f in ("zh", "answer_zh") if not q.get(f)]
        if missing:
            raise BankError(f"question {q['id']!r} has no {' or '.join(missing)}; allowed: --lang en, or add the "
                            "Chinese question (zh) and answer (answer_zh) to the bank")
        return q["zh"]
    return q["en"] + (f"\n({q['zh']})" if q.get("zh") and q["kind"] != "practice" else "")


def run(lesson: int | None = None, seed: int | None = None, lang: str = "en", bank: Path | str = BANK,
        ask=input, out=print) -> int:
    """Ask each selected question, wait for Enter (q quits; at the end of stdin it stops waiting), then
    show the answer, its numbers with their sources, and where to read more. Returns how many were shown."""
    if lang not in ("en", "zh"):
        raise BankError(f"lang {lang!r} is not available; allowed: en, zh")
    questions = select(load_bank(bank), lesson, seed)
    words = WORDS[lang]
    waiting = True
    for i, q in enumerate(questions, 1):
        kind = KIND_ZH[q["kind"]] if lang == "zh" else q["kind"]
        label = f"{q['id']}" if q["kind"] == "practice" else words["kind"].format(kind=kind)
        text = question_text(q, lang)
        out(f"\n[{i}/{len(questions)}] {words['lesson'].format(n=q['lesson'])} · {label}")
        out(_wrap_text(text))
        if waiting:
            try:
                out(words["wait"])
                if ask("").strip().lower() == "q":
                    return i - 1
            except EOFError:
                waiting = False
        answer, numbers = shown(q, lang)
        out(_wrap_text(words["answer"] + answer))
        for line in numbers:
            out(f"  {line}")
        out(words["more"] + read_more(q, lang))
    return len(questions)


def _wrap_text(text: str, width: int = 100) -> str:
    return "\n".join(textwrap.fill(line, width, break_long_words=False) for line in text.splitlines())
