"""Grading: run a lab's tests against a copy and score it task by task.

`python -m minillm lab grade kv_cache --repo DIR [DIR ...]` grades each copy. The tests come from
the repository this module belongs to (the teacher's reference), not from the copy, so editing
the copy's tests earns nothing. Each copy is graded in its own pytest process with the copy
first on sys.path: a crash, a hang (after --timeout seconds), an import error or
NotImplementedError fails tasks, never the grader. The outcomes come back through
pytest_plugin.py, one JSON line per event.
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import pytest_plugin
from .registry import REPO, Lab, LabError, Task, get_lab

DEFAULT_TIMEOUT = 900                                # seconds per graded copy
PLUGIN_NAME = "_minillm_lab_report"                  # pytest_plugin.py's name in a grading process


@functools.lru_cache(maxsize=None)
def _selector_pattern(selector: str) -> re.Pattern:
    return pytest_plugin.compile_selector(selector)


def _matches(selector: str, nodeid: str) -> bool:
    return _selector_pattern(selector).fullmatch(nodeid) is not None


@dataclass
class TaskResult:
    task: Task
    passed: bool
    n_passed: int = 0
    n_failed: int = 0
    n_skipped: int = 0
    message: str = ""               # the first failure (or why nothing ran)


@dataclass
class LabResult:
    lab: Lab
    repo: Path
    tasks: list[TaskResult] = field(default_factory=list)
    error: str = ""                 # about the run as a whole (crash, timeout, wrong import)
    seconds: float = 0.0

    @property
    def n_passed(self) -> int:
        return sum(t.passed for t in self.tasks)

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    @property
    def percent(self) -> int:
        return round(100 * self.n_passed / self.n_tasks) if self.n_tasks else 0

    def summary_line(self) -> str:
        return f"{self.lab.name}: {self.n_passed}/{self.n_tasks} tasks, {self.percent}%"


def _run_pytest_subprocess(repo: Path, files: list[str], selectors: list[str], tests_root: Path,
                           timeout: float, python: str) -> tuple[list[dict], str]:
    """pytest in a fresh process, cwd = the copy, the copy first on sys.path. Returns (records, note)."""
    with tempfile.TemporaryDirectory(prefix="minillm-lab-") as tmp:
        tmp = Path(tmp)
        shutil.copyfile(pytest_plugin.__file__, tmp / f"{PLUGIN_NAME}.py")
        report = tmp / "report.jsonl"
        (tmp / "report.jsonl.json").write_text(json.dumps(selectors), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(repo), str(tmp)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["MINILLM_LAB_REPORT"] = str(report)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        cmd = [python, "-m", "pytest", "-p", PLUGIN_NAME, "-p", "no:cacheprovider", "-o", "addopts=",
               "-q", "--rootdir", str(tests_root), "-c", str(tests_root / "pytest.ini")]
        cmd += [str(tests_root / f) for f in files]
        log = tmp / "pytest.log"
        note = ""
        with open(log, "wb") as logf:
            proc = subprocess.Popen(cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
                note = f"timed out after {timeout:.0f} s"
                code = None
        records = []
        if report.exists():
            for line in report.read_text(encoding="utf-8").splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass                                       # a line cut short by a crash
        if not any(r["kind"] == "finish" for r in records) and not note:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
            note = f"pytest stopped early (exit code {code})" + (f": {' | '.join(tail)}" if tail else "")
        return records, note


def _kill(proc: subprocess.Popen) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run_pytest_in_process(files: list[str], selectors: list[str], tests_root: Path) -> tuple[list[dict], str]:
    """pytest.main in this process (a notebook's self-check): fast, but a crash is this process's."""
    import pytest

    recorder = pytest_plugin.Recorder(selectors)
    args = ["-p", "no:cacheprovider", "-p", "no:faulthandler", "-o", "addopts=", "-q", "--capture=sys",
            "--rootdir", str(tests_root),
            "-c", str(tests_root / "pytest.ini")] + [str(tests_root / f) for f in files]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        pytest.main(args, plugins=[recorder])
    return recorder.records, ""


def _score(lab: Lab, tasks: list[Task], records: list[dict]) -> list[TaskResult]:
    collected = [n for r in records if r["kind"] == "collected" for n in r["nodeids"]]
    phases: dict[str, list[tuple[str, str]]] = {}
    for r in records:
        if r["kind"] == "test":
            phases.setdefault(r["nodeid"], []).append((r["outcome"], r["message"]))

    def final(nodeid):                      # failed in any phase > skipped > passed; None: never reported
        seen = phases.get(nodeid, [])
        for wanted in ("failed", "skipped", "passed"):
            for outcome, msg in seen:
                if outcome == wanted:
                    return outcome, msg
        return None, "did not finish (crash or timeout)"

    collect_problems = [r for r in records if r["kind"] == "collect"]
    results = []
    for task in tasks:
        res, skip_reason = TaskResult(task, passed=False), ""
        for selector in task.tests:
            ids = [n for n in collected if _matches(selector, n)]
            if not ids:
                file = selector.split("::")[0]
                why = next((f"{p['outcome']} at collection: {p['message']}" for p in collect_problems
                            if p["nodeid"] == file or p["nodeid"].startswith(file + "::")), "no such test (did it run?)")
                res.n_failed += 1
                res.message = res.message or f"{selector}: {why}"
            for nodeid in ids:
                outcome, msg = final(nodeid)
                if outcome == "passed":
                    res.n_passed += 1
                elif outcome == "skipped":
                    res.n_skipped += 1
                    skip_reason = skip_reason or msg
                else:
                    res.n_failed += 1
                    res.message = res.message or f"{nodeid}: {msg}"
        res.passed = res.n_failed == 0 and res.n_passed > 0
        if not res.passed and not res.message:
            res.message = f"every test skipped: {skip_reason}"
        results.append(res)
    return results


def grade_labs(repo, labs: list[str], tasks: list[str] | None = None, isolated: bool = True,
               timeout: float = DEFAULT_TIMEOUT, tests_root: Path = REPO, python: str | None = None) -> list[LabResult]:
    """Grade one copy on one or more labs in ONE pytest run; never raises for what the copy does.

    isolated=True: a fresh process (the grader's choice); False: this process, which must have
    imported minillm from `repo` (a notebook's self-check)."""
    lab_objs = [get_lab(name) for name in labs]
    repo, tests_root = Path(repo).resolve(), Path(tests_root).resolve()
    chosen = {lab.name: ([lab.task(t) for t in tasks] if tasks else list(lab.tasks)) for lab in lab_objs}
    selectors = list(dict.fromkeys(s for ts in chosen.values() for t in ts for s in t.tests))
    files = list(dict.fromkeys(s.split("::")[0] for s in selectors))
    start = time.perf_counter()
    if not (repo / "minillm").is_dir():
        records, note = [], f"{repo} holds no minillm package"
    elif isolated:
        records, note = _run_pytest_subprocess(repo, files, selectors, tests_root, timeout, python or sys.executable)
    else:
        if REPO != repo:
            raise LabError(f"in-process grading needs minillm imported from {repo}, not {REPO}")
        records, note = _run_pytest_in_process(files, selectors, tests_root)
    finish = next((r for r in records if r["kind"] == "finish"), None)
    if finish:
        for name, origin in finish["origins"].items():
            if origin and not Path(origin).resolve().is_relative_to(repo):
                note = f"the tests imported {name} from {origin}, not from {repo}: nothing was graded"
                records = []
    seconds = time.perf_counter() - start
    return [LabResult(lab, repo, _score(lab, chosen[lab.name], records), note, seconds) for lab in lab_objs]


def score_records(lab: str, records: list[dict], repo=REPO) -> LabResult:
    """Score one lab from what a Recorder saw in a run that already happened (the test suite's own:
    tests/conftest.py): only the tests that ran count as collected, so a run that left some out is
    scored on those it ran."""
    ran = list(dict.fromkeys(r["nodeid"] for r in records if r["kind"] == "test"))
    kept = [{"kind": "collected", "nodeids": ran}] + [r for r in records if r["kind"] in ("test", "collect")]
    lab_obj = get_lab(lab)
    return LabResult(lab_obj, Path(repo).resolve(), _score(lab_obj, list(lab_obj.tasks), kept))


def grade(repo, lab: str, tasks: list[str] | None = None, **kwargs) -> LabResult:
    """Grade one copy on one lab (see grade_labs for the options)."""
    return grade_labs(repo, [lab], tasks, **kwargs)[0]


def grade_many(repos, lab: str, jobs: int = 1, **kwargs) -> list[LabResult]:
    """Grade several copies on one lab, each in its own process, `jobs` at a time; results in order."""
    repos = list(repos)
    if jobs <= 1:
        return [grade(r, lab, **kwargs) for r in repos]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda r: grade(r, lab, **kwargs), repos))


def submissions_in(folder) -> list[Path]:
    """Every sub-folder of `folder` that holds a minillm package (one per student)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LabError(f"{folder} is not a folder")
    return sorted(p for p in folder.iterdir() if (p / "minillm").is_dir())
