"""Solution markers: find the regions a student writes in a Python source and replace them by stubs.

The reference implementation marks what a student writes with comment lines, indented like the
code they wrap and always inside a function body: a line `# BEGIN SOLUTION <lab>`, the reference
code, and a line `# END SOLUTION`. In a student copy a lab's regions become a stub that raises
NotImplementedError, headed by the region's hint from the lab's hint file (hints.py), so the
signature and docstring survive and everything else still imports and runs; the markers of the
other labs are removed and their code kept. Hints never sit in the library's code.
"""
from __future__ import annotations

import ast
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from .registry import LABS, LabError

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION[ \t]+(?P<lab>\w+)(?P<rest>.*)$")
END_RE = re.compile(r"^(?P<indent>[ \t]*)# END SOLUTION\b")
HINT_RE = re.compile(r"^[ \t]*#[ \t]*HINT\b")                  # hints live in lessons/labs/hints/, not here
MARKER_RE = re.compile(r"^[ \t]*#[ \t]*(BEGIN|END) SOLUTION\b")     # what must not survive in a copy


@dataclass(frozen=True)
class Region:
    path: str                       # relative to the repository root
    lab: str
    begin: int                      # 1-based line of "# BEGIN SOLUTION"
    end: int                        # 1-based line of "# END SOLUTION"
    indent: str
    function: str                   # qualified name of the enclosing function

    def __str__(self) -> str:
        return f"{self.path}:{self.begin}-{self.end} {self.function}"


def _function_spans(tree: ast.AST) -> list[tuple[int, int, str]]:
    spans = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans.append((child.lineno, child.end_lineno, prefix + child.name))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)
    visit(tree, "")
    return spans


def parse_regions(text: str, path: str = "<text>") -> list[Region]:
    """The solution regions of one Python source, validated: paired, not nested, inside a function,
    with code in them at the marker's indentation."""
    lines = text.splitlines()
    if not any(MARKER_RE.match(line) for line in lines):
        return []
    try:
        spans = _function_spans(ast.parse(text))
    except SyntaxError as e:
        raise LabError(f"{path}: cannot parse ({e})") from e
    regions, open_ = [], None
    for no, line in enumerate(lines, 1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin:
            if open_:
                raise LabError(f"{path}:{no}: BEGIN SOLUTION inside the region opened at line {open_['begin']}")
            if begin["rest"].strip():
                raise LabError(f"{path}:{no}: text after the lab's name; a region's hint goes in its lab's hint "
                               f"file (lessons/labs/hints/)")
            open_ = dict(begin=no, lab=begin["lab"], indent=begin["indent"])
            continue
        if HINT_RE.match(line):
            raise LabError(f"{path}:{no}: a HINT line in the code; hints go in the lab's hint file (lessons/labs/hints/)")
        if end:
            if not open_:
                raise LabError(f"{path}:{no}: END SOLUTION without a BEGIN")
            if end["indent"] != open_["indent"]:
                raise LabError(f"{path}:{no}: END SOLUTION is not indented like its BEGIN (line {open_['begin']})")
            body = [(i, lines[i - 1]) for i in range(open_["begin"] + 1, no)
                    if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")]
            if not body:
                raise LabError(f"{path}:{open_['begin']}: the region holds no code")
            first = body[0][1]
            if first[:len(first) - len(first.lstrip())] != open_["indent"]:
                raise LabError(f"{path}:{body[0][0]}: the region's code must start at the marker's indentation")
            last_code = body[-1][0]                          # a function's end_lineno is its last code line
            inside = [s for s in spans if s[0] < open_["begin"] and last_code <= s[1]]
            if not inside:
                raise LabError(f"{path}:{open_['begin']}: a solution region must sit inside a function body")
            function = max(inside, key=lambda s: s[0])[2]
            regions.append(Region(path, open_["lab"], open_["begin"], no, open_["indent"], function))
            open_ = None
            continue
        if MARKER_RE.match(line):
            raise LabError(f"{path}:{no}: malformed marker {line.strip()!r}")
    if open_:
        raise LabError(f"{path}:{open_['begin']}: BEGIN SOLUTION without an END")
    return regions


def stub_lines(region: Region, hint: str = "") -> list[str]:
    """What replaces a region in the student copy: the hint as comments, then a raise."""
    lab = LABS.get(region.lab)
    where = lab.handout if lab else "the handout"
    ind = region.indent
    out = [f"{ind}# TODO(lab {region.lab}): write this part of {region.function} ({where})."]
    width = max(60, 120 - len(ind))                # hint lines keep the author's breaks unless very long
    for i, said in enumerate(hint.splitlines()):
        for j, line in enumerate(textwrap.wrap(said, width=width) or [""]):
            out.append(f"{ind}# {'HINT: ' if i == j == 0 else '      '}{line}".rstrip())
    msg = f"lab {region.lab}: {region.function} in {region.path} is yours to write (see {where})"
    out.append(f"{ind}raise NotImplementedError({msg!r})")
    return out


def strip_solutions(text: str, path: str, lab: str, hints: dict | None = None) -> tuple[str, list[Region]]:
    """A source with `lab`'s regions replaced by stubs (each headed by its hint in `hints`, Region -> text)
    and every other lab's markers removed. Returns the new text and the regions that were stubbed."""
    regions = parse_regions(text, path)
    if not regions:
        return text, []
    lines = text.splitlines(keepends=True)
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    out, stubbed, i = [], [], 0
    by_begin = {r.begin: r for r in regions}
    while i < len(lines):
        region = by_begin.get(i + 1)
        if region is None:
            out.append(lines[i])
            i += 1
            continue
        if region.lab == lab:
            out += [line + newline for line in stub_lines(region, (hints or {}).get(region, ""))]
            stubbed.append(region)
        else:
            out += lines[region.begin:region.end - 1]           # the code, without BEGIN and END
        i = region.end
    new = "".join(out)
    if stubbed:
        try:
            ast.parse(new)
        except SyntaxError as e:
            raise LabError(f"{path}: the stubbed source does not parse ({e}); check the regions") from e
    return new, stubbed


def leftover_markers(root: Path) -> list[str]:
    """'file:line' of every solution marker left under root (a student copy must have none)."""
    hits = []
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and p.suffix in (".py", ".md", ".txt", ".ipynb", ".cfg", ".toml", ".ini", ""):
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for no, line in enumerate(text.splitlines(), 1):
                if MARKER_RE.match(line):
                    hits.append(f"{p.relative_to(root)}:{no}")
    return hits
