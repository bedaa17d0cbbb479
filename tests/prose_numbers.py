"""The number guard: every figure in the prose names its source, and the source still says it.

A *figure* is a number a reader could repeat as a fact: one with a decimal point, a percentage,
a ratio (3.6x), a number with a unit of speed, size or time (57 tok/s, 538 MB, 14 ms), or a count of
100 or more that is not a power of two or a year. Small integers (30 layers, batch 16, lesson 02),
versions (torch 2.13), names (fp32, H200, Llama-2-70B), numbers written with a leading zero (lab 03)
and code spans are not figures.

Tables are stricter, because a table cell has no words around its number to say what it is. A *value
cell* holds only numbers with their units, connectors (/, vs, of, to, 和...), signs and markup; in a
value cell EVERY number is a figure, bare integers below 100, 0 and powers of two included (a quantise
time of "43" or "2" s needs its source like "43.2 s" does). Three places in a table hold names, not
results, and their bare integers are exempt:
  1. the header row (column names: "batch 16", "p50");
  2. the first cell of a row (the row's label: a batch size, a request number, a setting);
  3. a column whose header says its values are inputs or names: a code span (`max_num_seqs`), or a
     header ending in "(set)" (a run's setting), "(config)" (a model's shape) or "(id)" (a lesson's or
     lab's number); in Chinese （设定）, （配置）, （编号）.
A cell with words ("3 places", "temperature 0", a code span, a link) is prose: the prose rules apply.

Each figure is followed, in the same paragraph, table row or list item, by a GitHub footnote
reference `[^key]`. The reference covers every figure since the previous reference in that block,
in order, and its definition (one line, anywhere in the same file or notebook cell) says which kind:

    [^key]: measured in results/roofline.json: summary.bandwidth_bound_tok_s_float32; results(dtype="bfloat16").bound_tok_s
    [^key]: counted by minillm.perf.roofline: kv_bytes_per_token(LLAMA2_70B, 2) / 1024
    [^key]: published: FlashAttention README (github.com/Dao-AILab/flash-attention), "Memory" figure, A100 80GB

Measured and counted footnotes list one Python expression per figure, separated by `;`.
A measured expression reads the JSON file: a dict key is an attribute (`summary.ppl`), `[i]` or
`["key"]` indexes, and a list called with keyword filters returns its one matching row
(`results(dtype="bfloat16")`). A counted expression is evaluated in the named module. A figure
equals its value at the printed precision (3.62 covers [3.615, 3.625]); one written "~" or "≈"
is approximate (within 5%). A published footnote carries a citation, which the guard cannot check
beyond its presence: its figures are copied from the source by hand.

Run `python tests/prose_numbers.py [FILE...]` to list every problem (default: README, lessons,
notebooks); tests/course/test_lessons.py runs the same check.

The Chinese edition (README.zh.md, lessons/zh/) is checked the same way, and each Chinese file must quote
what its English twin quotes: the same footnote definitions, and at each footnote reference the same figures
(`twin_problems`). Numbers keep their English form in Chinese prose (3.6x, 57 tok/s, 538 MB); Chinese
characters next to a number are prose, and 约 / 大约 mark an approximate figure as ~ does.
"""
from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from minillm.course import results_view

ROOT = Path(__file__).resolve().parent.parent

UNITS = ("tok/s/request", "tok/s", "tokens/s", "token/s", "req/s", "GB/s", "TB/s", "MB/s", "GFLOP/s",
         "TFLOP/s", "PFLOP/s", "FLOP/s", "FLOP/byte", "FLOPs", "ms", "µs", "us", "ns", "s", "min",
         "GiB", "MiB", "KiB", "GB", "MB", "KB", "TB", "kB", "%", "x", "×", "points", "GHz")
CONNECTOR = re.compile(r"^\s*(?:/|vs\.?|-|–|to|and|or|,|、|，|和|与|或|到|至|对)\s*$")
APPROX = re.compile(r"(?:~|≈|about |roughly |around |大约|约)\s*$")
NUMBER = re.compile(r"[-+−]?\d+(?:,\d{3})*(?:\.\d+)?(?:[eE][-+]?\d+)?")
FOOTNOTE_REF = re.compile(r"\[\^([\w.-]+)\]")   # definitions are taken out of the blocks first
FOOTNOTE_DEF = re.compile(r"^\s*\[\^([\w.-]+)\]:\s*(.*)$")
CITATION = re.compile(r"https?://|arXiv|\b(?:paper|README|datasheet|Table|Section|Figure|Fig\.|§|blog|docs|"
                      r"documentation|spec|whitepaper|release notes)\b", re.I)
# Integers that are names, not results: SmolLM2-135M's shapes, round sizes, HTTP status codes, ports.
PLAIN_CONSTANTS = {576, 1536, 49152, 3072, 1000, 10000, 100000, 200, 400, 401, 403, 404, 413, 422, 429, 500, 503, 8000, 8080}
# Definitions and the machine's description, not results: a multiply-add is 2 FLOPs; the VMs have 24 GiB;
# the lent H200 reports 140 GiB (minillm.course.notebook.machine_name, in the README's notebook column).
PLAIN_PHRASES = {"2 FLOPs", "24 GiB", "140 GiB"}


def cjk(ch: str) -> bool:
    """A Chinese character or full-width punctuation: prose around a number, not part of a name."""
    return bool(ch) and ("\u3000" <= ch <= "\u9fff" or "\uff00" <= ch <= "\uffef")


@dataclass
class Figure:
    text: str         # as printed, with its unit
    value: float
    decimals: int
    approx: bool
    line: int
    start: int        # offset in the block


@dataclass
class Footnote:
    key: str
    kind: str         # measured | counted | published | ?
    source: str       # file or module
    exprs: list[str]
    line: int
    raw: str


@dataclass
class Problem:
    path: str
    line: int
    message: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.message}"


@dataclass
class Doc:
    """One markdown text (a file, or one notebook cell) with its footnote definitions."""
    path: str
    lines: list[tuple[int, str]]           # (line number for messages, text)
    footnotes: dict[str, Footnote] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- reading

def markdown_docs(path: Path) -> list[Doc]:
    rel = str(path.relative_to(ROOT)) if path.is_absolute() else str(path)
    if path.suffix == ".ipynb":
        nb = json.loads(path.read_text())
        docs = []
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] == "markdown":
                src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
                docs.append(Doc(f"{rel} (markdown cell {i})", list(enumerate(src.splitlines(), 1))))
        return docs
    return [Doc(rel, list(enumerate(path.read_text().splitlines(), 1)))]


def blocks(doc: Doc) -> tuple[list[list[tuple[int, str]]], list[Footnote]]:
    """Paragraphs, list items, table rows and headings outside fenced code; footnote definitions apart."""
    out, cur, fenced, notes = [], [], False, []

    def flush():
        if cur:
            out.append(list(cur))
            cur.clear()

    for no, text in doc.lines:
        if text.lstrip().startswith("```"):
            flush()
            fenced = not fenced
            continue
        if fenced:
            continue
        m = FOOTNOTE_DEF.match(text)
        if m:
            flush()
            notes.append(parse_footnote(m.group(1), m.group(2), no))
            continue
        stripped = text.strip()
        if not stripped:
            flush()
            continue
        body = stripped.lstrip("> ").strip()
        if stripped.startswith("|") or stripped.startswith("#"):
            flush()
            if not re.fullmatch(r"\|?[\s:|-]+\|?", stripped):
                out.append([(no, text)])
            continue
        if re.match(r"([-*+]|\d+\.)\s", body) or text.startswith("    ") and not cur:
            flush()
        cur.append((no, text))
    flush()
    return out, notes


def collect_footnotes(docs: list[Doc]) -> tuple[dict[str, Footnote], list[Problem]]:
    found, problems = {}, []
    for d in docs:
        for note in blocks(d)[1]:
            if note.key in found:
                problems.append(Problem(d.path, note.line, f"[^{note.key}] is defined twice"))
            found[note.key] = note
    return found, problems


def parse_footnote(key: str, body: str, line: int) -> Footnote:
    m = re.match(r"measured in (results/[\w./-]+\.json):\s*(.*)$", body)
    if m:
        return Footnote(key, "measured", m.group(1), split_exprs(m.group(2)), line, body)
    m = re.match(r"counted by ([\w.]+):\s*(.*)$", body)
    if m:
        return Footnote(key, "counted", m.group(1), split_exprs(m.group(2)), line, body)
    m = re.match(r"published:\s*(.*)$", body)
    if m:
        return Footnote(key, "published", m.group(1), [], line, body)
    return Footnote(key, "?", "", [], line, body)


def split_exprs(text: str) -> list[str]:
    return [e.strip().strip("`").strip() for e in text.split(";") if e.strip()]


# ------------------------------------------------------------------------------------- figures

def _blank(match) -> str:
    return " " * len(match.group(0))


def scrub(text: str) -> str:
    """Hide what is not prose, keeping offsets: code spans, link targets, HTML comments and tags."""
    text = re.sub(r"`[^`]*`", _blank, text)
    text = re.sub(r"\]\([^)]*\)", lambda m: "]" + " " * (len(m.group(0)) - 1), text)
    text = re.sub(r"<!--.*?-->", _blank, text)
    text = re.sub(r"</?\w+[^>]*>", _blank, text)
    text = re.sub(r"https?://\S+", _blank, text)
    return text


def unit_after(text: str, end: int) -> str:
    gap = re.match(r"[ \t\n\u202f\u00a0]*", text[end:]).group(0)
    if len(gap) > 1 and "\n" not in gap:
        return ""
    rest = text[end + len(gap):]
    for u in UNITS:
        if rest.startswith(u):
            after = rest[len(u):len(u) + 1]
            if not after or cjk(after) or not (after.isalnum() or after == "_"):
                if gap and u in ("x", "×"):
                    continue                                    # "3 x 64": a product, not a ratio
                return u
    return ""


VERSIONISH = re.compile(r"(?:(?i:torch|pytorch|triton|python|transformers|cuda|version)|Llama|LLaMA|Llama-|FA|"
                        r"FlashAttention-?|Section|section|§|Table|table|Figure|Fig\.|Eq\.|eq\.|step|Step|issue|"
                        r"Issue|item|Item|lesson|Lesson|stop|PEP|sm_|compute capability|llama\.cpp b|arXiv:?|第|图|表)\s*$")


@dataclass
class _Number:
    start: int
    end: int
    tok: str
    value: float
    decimals: int
    unit: str
    approx: bool
    is_figure: bool = False
    label: bool = False


def _numbers(text: str) -> list[_Number]:
    """Every number token in the prose that is not part of a name, a version or a tolerance."""
    found = []
    for m in NUMBER.finditer(text):
        s, e, tok = m.start(), m.end(), m.group(0)
        if tok[0] in "-+−" and s and text[s - 1] not in " (|[/\t":
            s, tok = s + 1, tok[1:]                             # "3.6-26": a range, not a minus sign
        left = text[s - 1] if s else " "
        if (left.isalnum() and not cjk(left)) or left in "_.^#$\\":
            continue
        if left in "-–/" and s >= 2 and text[s - 2].isalpha():
            continue                                            # AVX-512, Llama-2, w/2
        if re.fullmatch(r"[-+−]?1[eE][-+]?\d+", tok):
            continue                                            # 1e-3: a tolerance or a unit, not a result
        unit = unit_after(text, e)
        right = text[e:e + 1]
        if not unit and right and ((right.isalpha() and not cjk(right)) or right in "_³²"):
            continue                                            # 70B, 4K, 1st, 2048³
        if right == "." and text[e + 1:e + 2].isdigit():
            continue                                            # 1.2.3 version strings
        clean = tok.replace(",", "").replace("−", "-")
        mantissa, _, exponent = clean.lower().partition("e")
        decimals = (len(mantissa.split(".")[1]) if "." in mantissa else 0) - int(exponent or 0)
        approx = bool(APPROX.search(text[max(0, s - 9):s]))
        found.append(_Number(s, e, tok, float(clean), decimals, unit, approx))
    return found


@dataclass
class TableRow:
    """Where a table row's cells are (offsets in the row's text) and what its table's header says."""
    cells: list[tuple[int, int]]      # (start, end) of each cell, between the pipes
    header: list[str]                 # the header row's cell texts, one per column
    is_header: bool
    values: list[bool] = field(default_factory=list)   # per cell: holds only values (value_cell)

    def column(self, pos: int) -> int:
        return next((i for i, (a, b) in enumerate(self.cells) if a <= pos < b), -1)

    def value_cell(self, pos: int) -> bool:
        """Whether the cell at pos holds only values: numbers, their units, connectors (/, vs, of, to,
        和...), signs and markup, no other word. A cell with words ("3 places", "temperature 0", a code
        span, a link) is prose."""
        col = self.column(pos)
        return 0 <= col < len(self.values) and self.values[col]


def _only_values(cell: str) -> bool:
    cell = FOOTNOTE_REF.sub(" ", cell)
    rest = VALUE_WORDS.sub(" ", NUMBER.sub(" ", cell))
    return not re.search(r"[^\W\d_]", rest)


def _cells(text: str) -> list[tuple[int, int]]:
    """(start, end) of each cell of a markdown table row; an escaped pipe (\\|) does not split."""
    pipes = [i for i, ch in enumerate(text) if ch == "|" and (i == 0 or text[i - 1] != "\\")]
    bounds = [-1] + pipes + [len(text)]
    cells = [(x + 1, y) for x, y in zip(bounds, bounds[1:])]
    if pipes and not text[:pipes[0]].strip():
        cells = cells[1:]                                       # nothing before the leading pipe
    if pipes and not text[pipes[-1] + 1:].strip():
        cells = cells[:-1]                                      # nothing after the trailing pipe
    return cells


def table_rows(doc: Doc) -> dict[int, TableRow]:
    """Every table row of a doc by line number: its cells and its table's header."""
    out, header, lines = {}, None, doc.lines
    for i, (no, text) in enumerate(lines):
        stripped = text.strip()
        if not stripped.startswith("|"):
            header = None
            continue
        if SEPARATOR.fullmatch(stripped):
            continue
        nxt = lines[i + 1][1].strip() if i + 1 < len(lines) else ""
        is_header = bool(SEPARATOR.fullmatch(nxt)) and nxt.startswith("|")
        if is_header or header is None:
            header = [text[a:b].strip() for a, b in _cells(text)]
        cells = _cells(text)
        out[no] = TableRow(cells, header, is_header, [_only_values(text[a:b]) for a, b in cells])
    return out


SEPARATOR = re.compile(r"\|?[\s:|-]+\|?")
# what a value cell may hold beside its numbers: units and the connectors of CONNECTOR, as whole words
VALUE_WORDS = re.compile(r"(?<![^\W\d_])(?:" + "|".join(re.escape(u) for u in sorted(UNITS, key=len, reverse=True))
                         + r"|vs|of|to|and|or|和|与|或|到|至|对)(?![^\W\d_])")
# a column whose header says it holds inputs or names, not results: a code span (`max_num_seqs`), or a header
# ending in "(set)" (a run's setting), "(config)" (a model's shape) or "(id)" (a lesson's, lab's or request's
# number); in Chinese （设定）, （配置）, （编号）
SETTING_HEADER = re.compile(r"^`[^`]+`$|\((?:set|config|id)\)$|（(?:设定|配置|编号)）$")


def table_label(n: _Number, row: TableRow) -> bool:
    """A place in a table where a bare integer names a row or a column rather than reporting a result:
    the header row, the row's first cell (its label), a column whose header marks it (SETTING_HEADER)."""
    if row.is_header:
        return True
    col = row.column(n.start)
    return col == 0 or 0 <= col < len(row.header) and bool(SETTING_HEADER.search(row.header[col]))


def figures(text: str, line_of, table: TableRow | None = None) -> list[Figure]:
    numbers = _numbers(text)
    for n in numbers:
        bare = n.decimals == 0 and "e" not in n.tok.lower() and not n.unit
        in_value_cell = table is not None and table.value_cell(n.start)
        n.label = bare and (_leading_zero(n.tok) or in_value_cell and table_label(n, table))
        if in_value_cell:
            big = not n.label                                   # a table's value: every number is a figure
        else:
            big = (n.decimals == 0 and abs(n.value) >= 100 and not n.label and not _power_of_two(abs(n.value))
                   and not 1900 <= abs(n.value) <= 2099 and abs(n.value) not in PLAIN_CONSTANTS)
        n.is_figure = ((n.decimals > 0 or "e" in n.tok.lower() or bool(n.unit) or big)
                       and not VERSIONISH.search(text[max(0, n.start - 22):n.start])
                       and f"{n.tok} {n.unit}" not in PLAIN_PHRASES)
    # a unit written once for several numbers: "16.7 / 18.5 / 37 tok/s", "235 vs 230 tok/s", "8-64 MB"
    for n, after in reversed(list(zip(numbers, numbers[1:]))):
        if not n.unit and not n.label and after.is_figure and after.unit and CONNECTOR.match(text[n.end:after.start]):
            n.is_figure, n.unit = True, after.unit
    return [Figure(n.tok + (n.unit if n.unit in ("%", "x", "×") else (" " + n.unit if n.unit else "")),
                   n.value, n.decimals, n.approx, line_of(n.start), n.start)
            for n in numbers if n.is_figure]


def _leading_zero(tok: str) -> bool:
    """03, 09: a lesson's or a lab's number, a name rather than a quantity."""
    return len(tok) > 1 and tok[0] == "0" and tok[1].isdigit()


def _power_of_two(n: float) -> bool:
    n = int(n)
    return n > 0 and n & (n - 1) == 0


# ----------------------------------------------------------------------------------- evaluating

def evaluate(note: Footnote, expr: str) -> float:
    if note.kind == "measured":
        return float(results_view.evaluate(expr, results=ROOT / note.source))
    return float(results_view.evaluate(expr, module=note.source))


def agrees(fig: Figure, value: float) -> bool:
    if math.isnan(value):
        return False
    if fig.approx:
        return abs(value - fig.value) <= max(0.05 * abs(fig.value), 0.5 * 10 ** -fig.decimals)
    return abs(value - fig.value) <= 0.5 * 10 ** -fig.decimals * (1 + 1e-9) + 1e-12


# --------------------------------------------------------------------------------------- checking

def check_doc(doc: Doc, used: set[str]) -> list[Problem]:
    """Every figure of the doc covered by a footnote whose values agree; the keys used go into `used`."""
    problems: list[Problem] = []
    rows = table_rows(doc)
    for block in blocks(doc)[0]:
        text = "\n".join(t for _, t in block)
        starts, off = [], 0
        for no, t in block:
            starts.append((off, no))
            off += len(t) + 1

        def line_of(pos, starts=starts):
            return max(no for o, no in starts if o <= pos)

        refs = [(m.start(), m.group(1)) for m in FOOTNOTE_REF.finditer(text)]
        clean = scrub(FOOTNOTE_REF.sub(lambda m: " " * len(m.group(0)), text))
        figs = figures(clean, line_of, rows.get(block[0][0]) if len(block) == 1 else None)
        prev = -1
        for pos, key in refs:
            used.add(key)
            covered = [f for f in figs if prev < f.start < pos]
            prev = pos
            note = doc.footnotes.get(key)
            where = line_of(pos)
            if note is None:
                problems.append(Problem(doc.path, where, f"[^{key}] has no definition"))
                continue
            problems += check_footnote(doc, note, covered, where)
        for f in figs:
            if f.start > prev:
                problems.append(Problem(doc.path, f.line, f"{f.text!r} has no source: add a footnote [^key] "
                                                          "saying measured / counted / published"))
    return problems


def check_footnote(doc: Doc, note: Footnote, covered: list[Figure], line: int) -> list[Problem]:
    here = f"[^{note.key}]"
    if note.kind == "?":
        return [Problem(doc.path, note.line, f"{here} must start with 'measured in results/X.json:', "
                                             "'counted by module:' or 'published:'")]
    if note.kind == "published":
        if not CITATION.search(note.source) or len(note.source) < 15:
            return [Problem(doc.path, note.line, f"{here} is 'published' but names no source "
                                                 "(paper, README, datasheet, table, section or URL)")]
        return []
    shown = ", ".join(f.text for f in covered) or "none"
    if len(note.exprs) != len(covered):
        return [Problem(doc.path, line, f"{here} lists {len(note.exprs)} values but the figures before it "
                                        f"are {len(covered)}: {shown}")]
    problems = []
    for fig, expr in zip(covered, note.exprs):
        try:
            value = evaluate(note, expr)
        except Exception as exc:  # noqa: BLE001 (reported with its place)
            problems.append(Problem(doc.path, fig.line, f"{fig.text!r}: {here} `{expr}` fails: {exc}"))
            continue
        if not agrees(fig, value):
            problems.append(Problem(doc.path, fig.line, f"{fig.text!r} disagrees with its source: {here} "
                                                         f"`{expr}` = {value:.6g} ({note.source})"))
    return problems


def prose_files() -> list[Path]:
    readmes = [ROOT / "README.md"] + ([ROOT / "README.zh.md"] if (ROOT / "README.zh.md").exists() else [])
    return (readmes + sorted((ROOT / "lessons").glob("*.md")) + sorted((ROOT / "lessons").glob("*/*.md"))
            + sorted((ROOT / "lessons").glob("zh/*/*.md")) + sorted((ROOT / "notebooks").glob("*.ipynb")))


# ------------------------------------------------------------------------------- the Chinese twins

ZH = ROOT / "lessons" / "zh"


def twins() -> list[tuple[Path, Path]]:
    """(English, Chinese) pairs: README.zh.md, lessons/zh/NN-topic.md, lessons/zh/labs/*.md. The Chinese
    file need not exist: a missing twin is a problem the tests report."""
    english = ([ROOT / "README.md"] + sorted((ROOT / "lessons").glob("[0-9][0-9]-*.md"))
               + sorted((ROOT / "lessons" / "labs").glob("*.md")))
    return [(en, ROOT / "README.zh.md" if en.name == "README.md" and en.parent == ROOT
             else ZH / en.relative_to(ROOT / "lessons")) for en in english]


def quoted(path: Path) -> list[tuple[str, tuple[tuple[float, int], ...]]]:
    """Every footnote reference of a file with the figures it covers, as (key, ((value, decimals), ...)),
    in file order: what the file quotes, independent of the language around the numbers."""
    docs = markdown_docs(path)
    out = []
    for doc in docs:
        rows = table_rows(doc)
        for block in blocks(doc)[0]:
            text = "\n".join(t for _, t in block)
            refs = [(m.start(), m.group(1)) for m in FOOTNOTE_REF.finditer(text)]
            figs = figures(scrub(FOOTNOTE_REF.sub(lambda m: " " * len(m.group(0)), text)), lambda pos: 0,
                           rows.get(block[0][0]) if len(block) == 1 else None)
            prev = -1
            for pos, key in refs:
                out.append((key, tuple((f.value, f.decimals) for f in figs if prev < f.start < pos)))
                prev = pos
    return out


def twin_problems(en: Path, zh: Path) -> list[str]:
    """The Chinese twin quotes the same numbers under the same footnotes as the English file."""
    rel = lambda p: str(p.relative_to(ROOT))  # noqa: E731
    if not zh.exists():
        return [f"{rel(en)} has no Chinese twin {rel(zh)}"]
    problems = []
    en_notes = {n.key: n for d in markdown_docs(en) for n in blocks(d)[1]}
    zh_notes = {n.key: n for d in markdown_docs(zh) for n in blocks(d)[1]}
    for key in sorted(en_notes.keys() ^ zh_notes.keys()):
        where = rel(en) if key in en_notes else rel(zh)
        problems.append(f"[^{key}] is defined only in {where}")
    for key in sorted(en_notes.keys() & zh_notes.keys()):
        a, b = en_notes[key], zh_notes[key]
        if (a.kind, a.source if a.kind != "published" else "", a.exprs) != \
                (b.kind, b.source if b.kind != "published" else "", b.exprs):
            problems.append(f"[^{key}] says {b.raw!r} in {rel(zh)} but {a.raw!r} in {rel(en)}")
    from collections import Counter
    en_q, zh_q = Counter(quoted(en)), Counter(quoted(zh))
    show = lambda vals: ", ".join(f"{v:.{max(d, 0)}f}" for v, d in vals) or "no figure"  # noqa: E731
    for (key, vals), n in sorted((en_q - zh_q).items()):
        problems.append(f"{rel(en)} quotes {show(vals)} at [^{key}] ({n}x) and {rel(zh)} does not")
    for (key, vals), n in sorted((zh_q - en_q).items()):
        problems.append(f"{rel(zh)} quotes {show(vals)} at [^{key}] ({n}x) and {rel(en)} does not")
    return problems


def check_file(path: Path) -> list[Problem]:
    """A markdown file, or a notebook whose markdown cells share one set of footnotes."""
    docs = markdown_docs(path)
    footnotes, problems = collect_footnotes(docs)
    used: set[str] = set()
    for d in docs:
        d.footnotes = footnotes
        problems += check_doc(d, used)
    for key, note in footnotes.items():
        if key not in used:
            problems.append(Problem(str(path.relative_to(ROOT)), note.line, f"[^{key}] is defined but never referenced"))
    return problems


def main(argv: list[str]) -> int:
    paths = [Path(a).resolve() for a in argv] or prose_files()
    problems = [p for path in paths for p in check_file(path)]
    english_of = {zh: en for en, zh in twins()}
    problems += [p for path in paths if path in english_of for p in twin_problems(english_of[path], path)]
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s) in {len(paths)} file(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
