"""The hints of a lab, one file per lab (lessons/labs/hints/NN-<lab>.md), kept out of the library's code.

A hint file has one section per solution region, file by file in the order of the lab's files, then in
the order of the code:

    ## `minillm/engine/scheduler.py`: `Scheduler.schedule`

    follow the module docstring. ...

The student copy writes each hint, as comments, above the stub that replaces its region; the grader
names the file when a task fails; the handout links it.
"""
from __future__ import annotations

import re
from pathlib import Path

from .registry import REPO, LabError, get_lab

HEADING_RE = re.compile(r"^## `(?P<path>[^`]+)`: `(?P<function>[^`]+)`\s*$")


def hint_file(lab: str, repo: Path = REPO) -> Path:
    return Path(repo) / "lessons" / "labs" / "hints" / Path(get_lab(lab).handout).name


def read_hints(lab: str, repo: Path = REPO) -> list[tuple[str, str, str]]:
    """(path, function, hint) for every section of the lab's hint file, in order; the hint keeps its lines."""
    path = hint_file(lab, repo)
    if not path.is_file():
        raise LabError(f"lab {lab}: no hint file {path.relative_to(Path(repo))}")
    sections, current = [], None
    for line in path.read_text(encoding="utf-8").splitlines():
        heading = HEADING_RE.match(line)
        if heading:
            current = [heading["path"], heading["function"], []]
            sections.append(current)
        elif current is not None:
            current[2].append(line)
    return [(p, f, "\n".join(lines).strip("\n")) for p, f, lines in sections]


def hints_by_region(regions, lab: str, repo: Path = REPO) -> dict:
    """Region -> its hint, matching the lab's regions (in code order) with the hint file's sections one to one."""
    sections = read_hints(lab, repo)
    order = {name: i for i, name in enumerate(get_lab(lab).files)}          # the handout's order of files
    regions = sorted(regions, key=lambda r: (order.get(r.path, len(order)), r.path, r.begin))
    keys = [(r.path, r.function) for r in regions]
    if [(p, f) for p, f, _ in sections] != keys or not all(h for _, _, h in sections):
        raise LabError(f"lab {lab}: {hint_file(lab, repo).relative_to(Path(repo))} must have one non-empty section per "
                       f"solution region, in code order: {[f'{p}: {f}' for p, f in keys]}; it has "
                       f"{[f'{p}: {f}' for p, f, _ in sections]}")
    return {region: hint for region, (_, _, hint) in zip(regions, sections)}
