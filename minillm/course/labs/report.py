"""What the lab commands print and write: the lab list, a copy's score per task, one row per
copy for a class, and a CSV of the scores.
"""
from __future__ import annotations

import csv
from pathlib import Path

from .grader import LabResult
from .hints import hint_file
from .registry import LABS


def format_result(result: LabResult, tests: bool = False) -> str:
    lab = result.lab
    lines = [f"lab {lab.name} ({lab.number:02d}, {lab.title}) -- {result.repo}"]
    width = max(len(t.task.name) for t in result.tasks) if result.tasks else 0
    for i, t in enumerate(result.tasks, 1):
        counts = f"{t.n_passed}/{t.n_passed + t.n_failed} tests" + (f", {t.n_skipped} skipped" if t.n_skipped else "")
        lines.append(f"  {'PASS' if t.passed else 'FAIL'}  {i}. {t.task.name:<{width}}  {t.task.title}  [{counts}]")
        if not t.passed and t.message:
            lines.append("        " + t.message.strip().splitlines()[0][:300])
        if tests:
            lines += [f"        {s}" for s in t.task.tests]
    if result.error:
        lines.append(f"  note: {result.error}")
    if any(not t.passed for t in result.tasks):
        lines.append(f"  hints: {hint_file(lab.name, '.')}")
    lines.append(result.summary_line())
    return "\n".join(lines)


def format_row(result: LabResult, name_width: int = 20) -> str:
    marks = " ".join(f"{t.task.name}{'+' if t.passed else '-'}" for t in result.tasks)
    row = f"{result.repo.name:<{name_width}} {result.summary_line():<34} {marks}"
    return row + (f"  ({result.error})" if result.error else "")


def write_csv(results: list[LabResult], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [t.task.name for t in results[0].tasks] if results else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "repo", "lab", *names, "tasks_passed", "tasks_total", "percent", "seconds", "note"])
        for r in results:
            w.writerow([r.repo.name, str(r.repo), r.lab.name, *[int(t.passed) for t in r.tasks],
                        r.n_passed, r.n_tasks, r.percent, f"{r.seconds:.1f}", r.error])
    return path


def format_lab_list(verbose: bool = False) -> str:
    lines = [f"{'#':>2}  {'lab':<18} {'time':>7}  {'tasks':>5}  title"]
    for lab in LABS.values():
        lines.append(f"{lab.number:>2}  {lab.name:<18} {lab.minutes:>4} min  {len(lab.tasks):>5}  {lab.title}")
        if verbose:
            lines.append(f"{'':>4}handout: {lab.handout}")
            lines += [f"{'':>4}write:   {fn}" for fn in lab.functions]
            lines += [f"{'':>4}task {i}: {t.name} - {t.title}" for i, t in enumerate(lab.tasks, 1)]
            lines += [f"{'':>4}target:  {x}" for x in lab.targets]
    return "\n".join(lines)
