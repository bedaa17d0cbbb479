"""Every figure in README.md, lessons/ and the notebooks' markdown names its source, and agrees with it.

The rules and the footnote notation are in tests/prose_numbers.py. When a benchmark is re-run, the
failure lists every sentence whose figure no longer equals its JSON value, with file and line.
"""
import json
import textwrap

import pytest

import prose_numbers as guard
from prose_numbers import ROOT

FILES = guard.prose_files()


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_every_figure_has_a_source_that_agrees(path):
    problems = guard.check_file(path)
    assert not problems, "\n".join(map(str, problems))


def check_text(tmp_path, text, name="lesson.md"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return [p.message for p in guard.check_file(path)]


@pytest.fixture
def tmp_path(tmp_path_factory):
    # inside the repository, so that footnotes can name results/*.json and paths print relative to ROOT
    d = ROOT / "results" / "quick" / "guard-test"
    d.mkdir(parents=True, exist_ok=True)
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def test_a_measured_figure_changed_by_hand_is_named_with_file_and_line(tmp_path):
    bound = json.loads((ROOT / "results/roofline.json").read_text())["summary"]["bandwidth_bound_tok_s_float32"]
    good = f"""
        The bound is {bound:.1f} tok/s[^b] here.

        [^b]: measured in results/roofline.json: summary.bandwidth_bound_tok_s_float32
        """
    assert check_text(tmp_path, good) == []
    bad = good.replace(f"{bound:.1f} tok/s", f"{bound + 0.2:.1f} tok/s")
    path = tmp_path / "lesson.md"
    path.write_text(textwrap.dedent(bad))
    (problem,) = guard.check_file(path)
    assert problem.line == 2 and problem.path.endswith("lesson.md")
    assert f"{bound + 0.2:.1f} tok/s" in problem.message and "disagrees" in problem.message


def test_printed_precision_decides_equality(tmp_path):
    text = """
        Ratios 3.62x and 3.6x and 4x[^r], approximately ~3.5x[^a].

        [^r]: counted by math: 3.6248; 3.6248; 3.6248
        [^a]: counted by math: 3.6248
        """
    assert check_text(tmp_path, text) == []
    assert check_text(tmp_path, text.replace("3.62x", "3.63x"))
    assert check_text(tmp_path, text.replace("~3.5x", "~3.3x"))


def test_a_bare_figure_fails_and_plain_constants_do_not(tmp_path):
    problems = check_text(tmp_path, """
        SmolLM2 has 30 layers of width 576, 2 bytes per bf16 value, lesson 02, batch 16, torch 2.13, fp32, H200,
        Llama-2-70B, 2048 tokens, in 2026. It decodes at 61.9 tok/s.
        """)
    assert len(problems) == 1 and "'61.9 tok/s' has no source" in problems[0]


def test_every_number_of_a_table_value_cell_is_a_figure_unless_a_stated_rule_exempts_it(tmp_path):
    """Issue 41: lesson 04's table said 43 s for GPTQ where the JSON says 32, and slipped through as a bare
    integer below 100. In a table's value cells every number is a figure; the row's label, the header and
    a column marked (set) / (config) / (id) or headed by a code span hold names; a cell with words is prose."""
    seconds = json.loads((ROOT / "results/quant.json").read_text())["results"]
    gptq = next(r for r in seconds if r["method"] == "gptq-4bit-g128")["quantize_s"]
    good = f"""
        | run 1 | batch (set) | `max_num_seqs` | layers (config) | lab (id) | quantise s | notes |
        |---|---:|---:|---:|---:|---:|---|
        | 4 | 16 | 7 | 30 | 12 | {gptq:.0f}[^q] | 3 places, temperature 0 |

        [^q]: measured in results/quant.json: results(method="gptq-4bit-g128").quantize_s
        """
    assert check_text(tmp_path, good) == []
    changed = check_text(tmp_path, good.replace(f"| {gptq:.0f}[^q] |", f"| {gptq + 11:.0f}[^q] |"))
    assert len(changed) == 1 and f"'{gptq + 11:.0f}' disagrees" in changed[0]
    for exempt in ("| 5 | 16 |", "| 4 | 17 |", "| 16 | 8 | 30 |", "| 31 | 12 |", "| 30 | 11 |"):
        edited = good.replace({"| 5 | 16 |": "| 4 | 16 |", "| 4 | 17 |": "| 4 | 16 |", "| 16 | 8 | 30 |": "| 16 | 7 | 30 |",
                               "| 31 | 12 |": "| 30 | 12 |", "| 30 | 11 |": "| 30 | 12 |"}[exempt], exempt)
        assert check_text(tmp_path, edited) == [], exempt          # labels and marked columns are names
    zh = good.replace("batch (set)", "batch（设定）").replace("layers (config)", "层数（配置）").replace("lab (id)", "实验（编号）")
    assert check_text(tmp_path, zh.replace("| 4 | 16 | 7 | 30 | 12 |", "| 4 | 17 | 7 | 31 | 11 |")) == []
    unsourced = check_text(tmp_path, good.replace(" | 3 places, temperature 0 |", " | 2 |"))
    assert len(unsourced) == 1 and "'2' has no source" in unsourced[0]  # a bare 2 in a value cell: a figure
    assert check_text(tmp_path, "Batch 16 took 2 passes; GPTQ took 43 s.\n") == ["'43 s' has no source: add a "
                                                                               "footnote [^key] saying measured / "
                                                                               "counted / published"]


def test_a_unit_written_once_covers_every_number_before_it(tmp_path):
    problems = check_text(tmp_path, "Rows of 16.7 / 18.5 / 37 tok/s and 235 vs 230 tok/s.\n")
    assert [p.split("'")[1] for p in problems] == ["16.7 tok/s", "18.5 tok/s", "37 tok/s", "235 tok/s", "230 tok/s"]


def test_a_footnote_must_list_one_value_per_figure_and_name_a_kind(tmp_path):
    problems = check_text(tmp_path, """
        | a | 1.5 ms | 2.5 ms[^two] |
        | b | 7.5 ms[^what] |

        [^two]: measured in results/roofline.json: summary.bandwidth_bound_tok_s_float32
        [^what]: from an old run
        """)
    assert any("lists 1 values but the figures before it are 2" in p for p in problems)
    assert any("must start with" in p for p in problems)


def test_a_published_figure_needs_a_citation(tmp_path):
    text = """
        An H200 reads 4.8 TB/s[^h200].

        [^h200]: published: NVIDIA H200 Tensor Core GPU datasheet (2024), SXM column
        """
    assert check_text(tmp_path, text) == []
    assert any("names no source" in p for p in check_text(tmp_path, text.replace("NVIDIA H200 Tensor Core GPU "
                                                                                  "datasheet (2024), SXM column",
                                                                                  "everyone knows this")))


def test_undefined_unused_and_broken_footnotes_are_reported(tmp_path):
    problems = check_text(tmp_path, """
        Fast: 9.5 ms[^missing]. Slow: 12.5 ms[^bad].

        [^bad]: measured in results/roofline.json: summary.no_such_key
        [^spare]: counted by math: 1.0
        """)
    assert any("[^missing] has no definition" in p for p in problems)
    assert any("`summary.no_such_key` fails" in p for p in problems)
    assert any("[^spare] is defined but never referenced" in p for p in problems)


def test_rows_of_a_results_list_are_selected_by_their_fields(tmp_path):
    rows = json.loads((ROOT / "results/roofline.json").read_text())["results"]
    bf16 = next(r for r in rows if r["dtype"] == "bfloat16")["bound_tok_s"]
    text = f"""
        bf16 bound {bf16:.1f} tok/s[^bf16].

        [^bf16]: measured in results/roofline.json: results(dtype="bfloat16").bound_tok_s
        """
    assert check_text(tmp_path, text) == []


def test_code_blocks_spans_and_links_are_not_prose(tmp_path):
    assert check_text(tmp_path, """
        Run `bench --tokens 12.5` or see [the page](https://example.com/3.5x-faster).

        ```
        speed = 61.9 tok/s
        ```
        """) == []


CARD = {"en": ("## Interview card", ["### 30-second answers", "### Follow-ups at GPU scale",
                                     "### The article says X; the truth is Y", "### Does it transfer to a GPU?"]),
        "zh": ("## 面试卡片", ["### 30 秒回答", "### GPU 规模的追问", "### 原文说 X；实际是 Y", "### 能否迁移到 GPU？"])}
LESSONS = [("en", p) for p in sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md"))] + \
          [("zh", p) for p in sorted((ROOT / "lessons" / "zh").glob("[0-9][0-9]-*.md"))]


@pytest.mark.parametrize("lang,path", LESSONS, ids=[str(p.relative_to(ROOT)) for _, p in LESSONS])
def test_every_lesson_opens_with_its_interview_card(lang, path):
    """The card is the first ## section, with its four parts in order and nothing else between them."""
    title, parts = CARD[lang]
    heads = [line.strip() for line in path.read_text().splitlines() if line.startswith("## ") or line.startswith("### ")]
    first = next(i for i, h in enumerate(heads) if h.startswith("## "))
    assert heads[first] == title
    assert heads[first + 1:first + 1 + len(parts)] == parts
