"""Numbers out of code comments: a measured speed written in a comment or docstring goes stale unseen (the
number guard, tests/prose_numbers.py, reads prose, not code). A comment keeps the rule ("the prepacked GEMM
wins from ~16 rows; see bench engine-step") and the number lives in results/ and the lessons.

Flagged in comments and docstrings under minillm/ and kernels/: a number with a unit of time or speed (ms,
us, tok/s, GB/s, GFLOP/s, ...) or "N x faster / slower / speed-up". A published figure that a constant is made
of (a datasheet's bandwidth) may stay, when its comment block (or docstring paragraph) says it is published and
names its source (a datasheet, a paper, a URL).
"""
from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path



ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"(?<![\w.-])\d[\d,]*(?:\.\d+)?(?:\s?[-–]\s?\d[\d,]*(?:\.\d+)?)?"     # 12.5, 2,039, 30-50
MEASURED = re.compile(NUMBER + r"\s?(?:ms|us|µs|ns|s/token|tok/s|tokens/s|[KMGT]i?B/s|[GT]FLOP/s|TFLOPS)(?![\w/])"
                      r"|" + NUMBER + r"\s?x\s+(?:faster|slower|speed-?up|quicker)", re.I)
SOURCE = re.compile(r"https?://|arXiv|§|\b(?:published|datasheets?|paper|whitepaper|specification|the article's claim)\b", re.I)


def comment_blocks(path: Path) -> list[tuple[int, str]]:
    """(first line, text) of every run of consecutive # comments and of every docstring paragraph in a file."""
    source = path.read_text()
    blocks, run, last = [], [], -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            line = tok.start[0]
            if line != last + 1 and run:
                blocks.append(run)
                run = []
            run.append((line, tok.string))
            last = line
    if run:
        blocks.append(run)
    out = [(b[0][0], "\n".join(text for _, text in b)) for b in blocks]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc and node.body:
                first = node.body[0].lineno
                for paragraph in re.split(r"\n\s*\n", doc):       # a source names the paragraph it sits in
                    out.append((first + doc[:doc.index(paragraph)].count("\n"), paragraph))
    return out


def measurement_like(root: Path = ROOT) -> list[str]:
    problems = []
    for path in sorted([*root.glob("minillm/**/*.py"), *root.glob("kernels/**/*.py")]):
        for line, text in sorted(comment_blocks(path)):
            if SOURCE.search(text):
                continue
            for match in MEASURED.finditer(text):
                problems.append(f"{path.relative_to(root)}:{line}: {match.group(0)!r}")
    return problems


def test_no_measured_number_sits_in_a_code_comment():
    problems = measurement_like()
    assert not problems, "measured numbers in code comments (keep the rule there, the number in results/):\n" + \
        "\n".join(problems)


def test_the_check_finds_a_planted_number(tmp_path):
    (tmp_path / "minillm").mkdir()
    (tmp_path / "minillm" / "x.py").write_text('"""Fast: 12.5 ms a step."""\n# about 3x faster than argmax\nX = 1\n'
                                               '# the A100 datasheet: 2,039 GB/s\nY = 2  # batch-1 tokens/s\n')
    assert measurement_like(tmp_path) == ["minillm/x.py:1: '12.5 ms'", "minillm/x.py:2: '3x faster'"]
