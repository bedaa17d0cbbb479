"""The Chinese edition (README.zh.md, lessons/zh/): a twin for every English lesson and handout, the same
numbers under the same footnotes, one glossary spelled one way, and links that lead somewhere.

The number guard itself (every figure has a source that agrees) runs over lessons/zh/ in test_lessons.py."""
import re
import textwrap
from pathlib import Path

import pytest

import prose_numbers as guard
from prose_numbers import ROOT, ZH

TWINS = guard.twins()
GLOSSARY = ZH / "术语表.md"
CHINESE_FILES = [ROOT / "README.zh.md"] + sorted(ZH.glob("*.md")) + sorted(ZH.glob("labs/*.md"))
HAN = r"[\u4e00-\u9fff]"


@pytest.mark.parametrize("en,zh", TWINS, ids=[str(en.relative_to(ROOT)) for en, _ in TWINS])
def test_every_english_lesson_has_a_chinese_twin_quoting_the_same_numbers(en, zh):
    problems = guard.twin_problems(en, zh)
    assert not problems, "\n".join(problems)


def test_the_twin_check_fails_when_one_number_changes_in_one_language(tmp_path):
    en, zh = tmp_path / "en.md", tmp_path / "zh.md"
    en.write_text(textwrap.dedent("""
        An H200 reads 4.8 TB/s and an A100 2.0 TB/s[^bw]; Llama-2-7B needs 512 KiB per token[^kv].

        [^bw]: published: NVIDIA H200 and A100 datasheets (2024), SXM columns
        [^kv]: counted by minillm.stages.kv_cache: kv_cache_bytes(32, 32, 128, 1, 1, 2) / 1024
        """))
    zh.write_text(textwrap.dedent("""
        H200 的显存带宽是 4.8 TB/s，A100 是 2.0 TB/s[^bw]；Llama-2-7B 每个 token 要 512 KiB[^kv]。

        [^bw]: published: NVIDIA H200 and A100 datasheets (2024), SXM columns
        [^kv]: counted by minillm.stages.kv_cache: kv_cache_bytes(32, 32, 128, 1, 1, 2) / 1024
        """))
    assert guard.twin_problems(en, zh) == []
    zh.write_text(zh.read_text().replace("2.0 TB/s", "2.1 TB/s"))       # a published figure: only the twin sees it
    problems = guard.twin_problems(en, zh)
    assert len(problems) == 2 and all("[^bw]" in p for p in problems), problems
    assert "2.0" in problems[0] + problems[1] and "2.1" in problems[0] + problems[1]
    zh.write_text(zh.read_text().replace("2.1 TB/s", "2.0 TB/s").replace("/ 1024", "/ 1000"))
    assert any("[^kv] says" in p for p in guard.twin_problems(en, zh))
    zh.unlink()
    assert guard.twin_problems(en, zh) == [f"{en.relative_to(ROOT)} has no Chinese twin {zh.relative_to(ROOT)}"]


@pytest.fixture
def tmp_path():
    d = ROOT / "results" / "quick" / "zh-guard-test"       # inside the repository: paths print relative to ROOT
    d.mkdir(parents=True, exist_ok=True)
    yield d
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


def test_chinese_prose_around_numbers_still_finds_every_figure():
    text = "解码约 61.9 tok/s，是 transformers 的3.6倍，大约 538 MB；第 300 步，16.7、18.5 和 37 tok/s。"
    figs = guard.figures(text, lambda pos: 1)
    assert [(f.value, f.approx) for f in figs] == [(61.9, True), (3.6, False), (538, True), (16.7, False),
                                                    (18.5, False), (37, False)]


# ------------------------------------------------------------------------------------- glossary

def glossary() -> list[dict]:
    rows = []
    for line in GLOSSARY.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 5 and re.search(HAN + "|KV", cells[0]) and cells[0] != "中文":
            zh, en, meaning, lesson, avoid = cells
            rows.append({"zh": zh, "en": en, "lesson": lesson,
                         "avoid": [a.strip() for a in re.split(r"[,，]", avoid) if a.strip()]})
    return rows


def lesson_zh(number: str) -> Path:
    (path,) = ZH.glob(f"{number}-*.md")
    return path


def test_the_glossary_is_complete_and_each_term_is_defined_where_it_says():
    rows = glossary()
    assert len(rows) >= 40
    for term in ("显存带宽", "算力", "预填充", "解码", "连续批处理", "分页注意力", "投机解码", "量化", "前缀缓存",
                 "张量并行", "流水线并行"):
        assert term in [r["zh"] for r in rows], term
    for r in rows:
        assert r["zh"] in lesson_zh(r["lesson"]).read_text(), f"{r['zh']} is not used in lesson {r['lesson']}"


def test_every_lesson_spells_each_glossary_term_the_glossarys_way():
    rows = glossary()
    terms = sorted((r["zh"] for r in rows), key=len, reverse=True)
    problems = []
    for path in [p for p in CHINESE_FILES if p != GLOSSARY and p.exists()]:
        text = "\n".join(l for l in path.read_text().splitlines() if not l.startswith(">"))  # quotes: the article's words
        name = path.relative_to(ROOT)
        without_terms = re.sub("|".join(map(re.escape, terms)), "|", text)   # 预填 inside 预填充 is no variant
        for r in rows:
            for variant in r["avoid"]:
                if variant in without_terms:
                    problems.append(f"{name} writes {variant!r}; the glossary's term is {r['zh']!r}")
            if not re.search(HAN, r["zh"]):
                continue
            english = [re.sub(r"\s*\(.*\)", "", r["en"])] + re.findall(r"\((\w[\w ]*)\)", r["en"])
            for e in english:
                for m in re.finditer(rf"[（(]\s*{re.escape(e)}\s*[）)]", text, flags=re.I):
                    before = re.sub(r"\s+", "", text[max(0, m.start() - 30):m.start()])
                    if re.search(HAN + "$", before) and not before.endswith(r["zh"].replace(" ", "")):
                        problems.append(f"{name} renders {e!r} as {before[-8:]!r}; the glossary's term is {r['zh']!r}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------- links

LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    from minillm.course.quiz import github_anchor
    fenced, found = False, set()
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(github_anchor(line.lstrip("#")))
    return found


@pytest.mark.parametrize("path", CHINESE_FILES, ids=[str(p.relative_to(ROOT)) for p in CHINESE_FILES])
def test_every_relative_link_of_the_chinese_edition_leads_to_a_file_and_section(path):
    assert path.exists(), f"{path.relative_to(ROOT)} is missing"
    problems = []
    for target in LINK.findall(path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            problems.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{target} (no such section in {dest.relative_to(ROOT)})")
    assert not problems, f"{path.relative_to(ROOT)}: " + "; ".join(problems)


@pytest.mark.parametrize("en,zh", TWINS, ids=[str(en.relative_to(ROOT)) for en, _ in TWINS])
def test_each_english_file_links_its_twin_and_both_link_the_same_notebook(en, zh):
    assert re.search(rf"\]\([^)]*{re.escape(zh.name)}\)", en.read_text()), f"{en.name} does not link {zh.name}"
    notebooks = lambda p: set(re.findall(r"notebooks/(\w+\.ipynb)", p.read_text()))  # noqa: E731
    assert notebooks(en) == notebooks(zh)


def _heading_levels(path: Path) -> list[int]:
    fenced, levels = False, []
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) ", line)):
            levels.append(len(m.group(1)))
    return levels


@pytest.mark.parametrize("en,zh", TWINS, ids=[str(en.relative_to(ROOT)) for en, _ in TWINS])
def test_a_twin_has_the_same_sections_in_the_same_order(en, zh):
    """Section i of the Chinese lesson answers what section i of the English one does: the quiz links there."""
    assert _heading_levels(zh) == _heading_levels(en)
