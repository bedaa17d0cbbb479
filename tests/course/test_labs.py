"""Classroom labs (minillm/course/labs/): solution markers, student copies, the grader.

For every lab: the reference repository scores 100%, a fresh student copy scores 0% without
crashing the grader, and the copy still imports minillm and runs the tiny model. The grading runs
are subprocesses (marked slow); the marker and CLI tests are fast.
"""
import csv
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import SESSION_RECORDER

from minillm.__main__ import main
from minillm.course import labs
from minillm.course.labs import pytest_plugin

REPO = Path(__file__).resolve().parents[2]
BEGIN, END = "# BEGIN " + "SOLUTION", "# END " + "SOLUTION"      # never at the start of a line here
NOTEBOOK_SPEC = REPO / "notebooks" / "10_labs.py"


# ---- the registry -------------------------------------------------------------------------------

def test_every_lab_has_regions_handout_tests_and_a_notebook_cell():
    regions = labs.find_regions(REPO)
    notebook = NOTEBOOK_SPEC.read_text()
    assert len(labs.LABS) >= 9
    for lab in labs.LABS.values():
        assert {r.path for r in regions if r.lab == lab.name} == set(lab.files), lab.name
        assert 2 <= len(lab.tasks) <= 7 and lab.minutes > 0 and lab.targets
        assert len({t.name for t in lab.tasks}) == len(lab.tasks)
        assert all(fn.split(":")[0] in lab.files for fn in lab.functions)
        handout = (REPO / lab.handout).read_text()
        assert all(t.name in handout for t in lab.tasks), f"{lab.handout} misses a task"
        assert f'self_check("{lab.name}"' in notebook
        for task in lab.tasks:
            for selector in task.tests:
                assert (REPO / selector.split("::")[0]).is_file(), selector
    assert (REPO / "lessons" / "labs" / "README.md").is_file()


def test_every_test_a_lab_names_is_collected(request):
    """A renamed test must not silently turn a task into 'no such test' at grading time. The node ids
    come from this run's collection where it collected every file the labs name (make test), else
    from a `pytest --collect-only` of those files."""
    import fnmatch

    named = {test for lab in labs.LABS.values() for task in lab.tasks for test in task.tests}
    files = sorted({test.split("::")[0] for test in named})
    recorder = request.config.pluginmanager.get_plugin(SESSION_RECORDER)
    here = [n for r in recorder.records if r["kind"] == "collected" for n in r["nodeids"]] if recorder else []
    if not all(any(n.startswith(f + "::") for n in here) for f in files):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", *files],
                             cwd=REPO, capture_output=True, text=True, timeout=300).stdout
        here = [line for line in out.splitlines() if "::" in line]
    collected = [nodeid.split("[")[0] for nodeid in here]
    missing = sorted(test for test in named        # a node id names a test, or a class of tests
                     if not any(fnmatch.filter(collected, pattern)
                                for pattern in (test.split("[")[0], test.split("[")[0] + "::*")))
    assert not missing, missing


def test_no_marker_sits_outside_a_registered_lab_and_every_region_has_a_hint_in_its_labs_hint_file():
    regions = labs.find_regions(REPO)
    assert all(region.lab in labs.LABS for region in regions)
    for lab in labs.LABS:
        mine = [r for r in regions if r.lab == lab]
        hints = labs.hints_by_region(mine, lab, REPO)              # one section per region, in order
        assert len(hints) == len(mine) > 0 and all(hints.values()), lab


def test_no_hint_line_in_library_or_kernel_code():
    """Hints are for students (lessons/labs/hints/); a reader of the library reads code and comments on why."""
    found = [f"{p.relative_to(REPO)}:{no}" for p in sorted([*(REPO / "minillm").rglob("*.py"), *(REPO / "kernels").glob("*.py")])
             for no, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if re.match(r"\s*#\s*HINT\b", line)]
    assert not found, found


def test_a_hint_file_out_of_step_with_the_code_is_refused(tmp_path):
    regions = [r for r in labs.find_regions(REPO) if r.lab == "scheduler"]
    hints = tmp_path / "lessons" / "labs" / "hints"
    hints.mkdir(parents=True)
    good = labs.hint_file("scheduler", REPO).read_text(encoding="utf-8")
    (hints / labs.hint_file("scheduler", REPO).name).write_text(good.split("\n## ")[0] + "\n## " + good.split("\n## ")[1])
    with pytest.raises(labs.LabError, match="one non-empty section per solution region"):
        labs.hints_by_region(regions, "scheduler", tmp_path)


# ---- markers and stubs ----------------------------------------------------------------------------

SOURCE = "\n".join([
    "def f(x):",
    '    """Add one."""',
    f"    {BEGIN} demo",
    "    y = x + 1",
    "    return y",
    f"    {END}",
    "",
    "",
    "class C:",
    "    def g(self, x):",
    "        for i in range(2):",
    f"            {BEGIN} other",
    "            x = x * 2",
    f"            {END}",
    "        return x",
    "",
])


def test_strip_solutions_stubs_one_lab_and_unwraps_the_others():
    regions = labs.parse_regions(SOURCE, "m.py")
    assert [(r.lab, r.function) for r in regions] == [("demo", "f"), ("other", "C.g")]
    student, stubbed = labs.strip_solutions(SOURCE, "m.py", "demo", {regions[0]: "think about it\nreally"})
    assert stubbed == regions[:1]
    ns = {}
    exec(student, ns)
    with pytest.raises(NotImplementedError, match="lab demo: f"):
        ns["f"](1)
    assert ns["f"].__doc__ == "Add one." and ns["C"]().g(3) == 12
    assert "x + 1" not in student and "think about it" in student and "really" in student
    assert not any(labs.MARKER_RE.match(line) for line in student.splitlines())
    other, _ = labs.strip_solutions(SOURCE, "m.py", "other")
    ns = {}
    exec(other, ns)
    assert ns["f"](1) == 2
    with pytest.raises(NotImplementedError):
        ns["C"]().g(3)


@pytest.mark.parametrize("bad, message", [
    ([f"def f():\n    {BEGIN} a\n    return 1\n"], "without an END"),
    ([f"def f():\n    return 1\n    {END}\n"], "without a BEGIN"),
    ([f"{BEGIN} a\nx = 1\n{END}\n"], "inside a function"),
    ([f"def f():\n    {BEGIN} a\n    {BEGIN} b\n    return 1\n    {END}\n    {END}\n"], "inside the region"),
    ([f"def f():\n    {BEGIN} a\n    return 1\n  {END}\n"], "not indented like"),
    ([f"def f():\n    {BEGIN} a\n    # why\n    {END}\n    return 1\n"], "holds no code"),
    ([f"def f():\n    {BEGIN} a: think\n    return 1\n    {END}\n"], "text after the lab's name"),
    ([f"def f():\n    {BEGIN} a\n    # HINT: think\n    return 1\n    {END}\n"], "a HINT line in the code"),
])
def test_bad_markers_are_clear_errors(bad, message):
    with pytest.raises(labs.LabError, match=message):
        labs.parse_regions(bad[0], "bad.py")


def test_make_refuses_unsafe_output_folders(tmp_path):
    with pytest.raises(labs.LabError, match="inside the reference"):
        labs.make_student_copy("kv_cache", REPO / "student-copy")
    with pytest.raises(labs.LabError, match="contains the reference"):
        labs.make_student_copy("kv_cache", REPO.parent)
    (tmp_path / "keep.txt").write_text("work")
    with pytest.raises(labs.LabError, match="not empty"):
        labs.make_student_copy("kv_cache", tmp_path)
    with pytest.raises(labs.LabError, match="unknown lab"):
        labs.make_student_copy("no_such_lab", tmp_path / "x")


# ---- command line (grading faked: argument handling only) -------------------------------------------

def test_cli_list_and_grade_arguments(capsys, monkeypatch, tmp_path):
    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in labs.LABS)
    calls = []

    def fake_grade(repo, lab, tasks=None, **kw):
        calls.append(("one", Path(repo).name, lab, tasks))
        return labs.LabResult(labs.get_lab(lab), Path(repo).resolve(), [])

    def fake_many(repos, lab, jobs=1, **kw):
        calls.append(("many", [Path(r).name for r in repos], lab, kw.get("tasks")))
        return [labs.LabResult(labs.get_lab(lab), Path(r).resolve(), []) for r in repos]

    monkeypatch.setattr(labs.grader, "grade", fake_grade)
    monkeypatch.setattr(labs.grader, "grade_many", fake_many)
    for name in ("a", "b"):
        (tmp_path / name / "minillm").mkdir(parents=True)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert main(["lab", "grade", "--repo", a, "scheduler"]) == 0
    assert main(["lab", "grade", "--repo", a, b, "gqa", "--tasks", "equal"]) == 0
    assert main(["lab", "grade", "kv_cache", "--submissions", str(tmp_path), "--csv", str(tmp_path / "s.csv")]) == 0
    assert calls == [("one", "a", "scheduler", None), ("many", ["a", "b"], "gqa", ["equal"]),
                     ("many", ["a", "b"], "kv_cache", None)]
    assert main(["lab", "grade", "--repo", a, "no_such_lab"]) == 2           # a clear error, not a traceback
    assert "which lab" in capsys.readouterr().err


LAB_LIST_ALONE = """
import runpy, sys
sys.argv = ["python -m minillm", "lab", "list"]
try:
    runpy.run_module("minillm", run_name="__main__", alter_sys=True)
except SystemExit as e:
    assert not e.code, e.code
heavy = [m for m in ("torch", "triton", "numpy", "minillm.engine.engine", "minillm.llm") if m in sys.modules]
assert not heavy, f"lab list imported {heavy}"
"""


def test_lab_list_imports_neither_torch_nor_the_engine():
    done = subprocess.run([sys.executable, "-c", LAB_LIST_ALONE], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(name in done.stdout for name in labs.LABS)


# ---- grading the reference and student copies (subprocesses) -----------------------------------------

@pytest.fixture(scope="module")
def reference_results(request):
    """Every lab graded on the reference. In a run that also ran every test the labs name (make test),
    the grader scores the outcomes its Recorder saw in this run (tests/conftest.py): the same tests,
    not run a second time. Otherwise, in the grader's own pytest process."""
    recorder = request.config.pluginmanager.get_plugin(SESSION_RECORDER)
    ran = {r["nodeid"] for r in recorder.records if r["kind"] == "test"} if recorder else set()
    selectors = {s for lab in labs.LABS.values() for task in lab.tasks for s in task.tests}
    if all(any(pytest_plugin.compile_selector(s).fullmatch(n) for n in ran) for s in selectors):
        return {name: labs.score_records(name, recorder.records) for name in labs.LABS}
    return {r.lab.name: r for r in labs.grade_labs(REPO, list(labs.LABS))}


@pytest.fixture(scope="module")
def student_copies(tmp_path_factory):
    root = tmp_path_factory.mktemp("copies")
    return {name: labs.make_student_copy(name, root / name) for name in labs.LABS}


@pytest.mark.slow
@pytest.mark.after_the_rest
@pytest.mark.parametrize("lab", list(labs.LABS))
def test_reference_scores_100(lab, reference_results):
    reference = reference_results[lab]
    assert reference.n_tasks == len(labs.get_lab(lab).tasks)
    assert reference.percent == 100 and not reference.error, labs.format_result(reference)


@pytest.fixture(scope="module")
def fresh_copy_results(student_copies):
    """Each fresh copy graded on its lab, two grading processes at a time (on two cores the second
    overlaps the first's imports and subprocess waits)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = pool.map(lambda lab: labs.grade(Path(student_copies[lab]["out"]), lab), labs.LABS)
        return dict(zip(labs.LABS, results))


@pytest.mark.slow
@pytest.mark.parametrize("lab", list(labs.LABS))
def test_a_fresh_copy_scores_0(lab, student_copies, fresh_copy_results):
    copy = student_copies[lab]
    out = Path(copy["out"])
    assert copy["stubbed"] and all(r.lab == lab for r in copy["stubbed"])
    assert labs.leftover_markers(out) == []
    assert not (out / ".venv").exists() and not list((out / "results").glob("*.png"))
    first = labs.read_hints(lab)[0]                              # the stub carries its hint from the hint file
    stubbed = (out / first[0]).read_text(encoding="utf-8")
    assert "# HINT: " + first[2].splitlines()[0].split()[0] in stubbed
    result = fresh_copy_results[lab]
    assert result.n_tasks == len(labs.get_lab(lab).tasks)
    assert result.n_passed == 0 and not result.error, labs.format_result(result)
    assert f"hints: lessons/labs/hints/{labs.get_lab(lab).number:02d}-{lab}.md" in labs.format_result(result)
    if not (lab == "flash_triton" and torch.cuda.is_available()):    # compiled, a raise is a compile error
        assert all("NotImplementedError" in t.message for t in result.tasks), labs.format_result(result)


SMOKE = """
import importlib, sys
import torch
for path in sys.argv[1:]:
    for name in [m for m in sys.modules if m == "minillm" or m.startswith(("minillm.", "kernels"))]:
        del sys.modules[name]
    sys.path.insert(0, path)
    import minillm
    from minillm.model.llama import random_model, tiny_config
    assert minillm.__file__.startswith(path), minillm.__file__
    for module in ("stages.kv_cache", "attention.gqa", "quant.int4", "quant.nf4", "quant.gptq", "attention.flash",
                   "kvcache.block_manager", "kvcache.prefix_cache", "engine.scheduler", "speculative.core", "llm",
                   "course.labs"):
        importlib.import_module("minillm." + module)
    logits = random_model(tiny_config(), seed=0)(torch.tensor([[1, 2, 3]]))
    assert logits.shape == (1, 3, 256) and torch.isfinite(logits).all()
    sys.path.remove(path)
    print("ok", path)
"""


@pytest.mark.slow
def test_student_copies_import_and_run_the_tiny_model(student_copies):
    paths = [str(c["out"]) for c in student_copies.values()]
    done = subprocess.run([sys.executable, "-c", SMOKE, *paths], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("ok ") == len(paths)


@pytest.mark.slow
def test_grading_a_class_in_one_command(student_copies, tmp_path, capsys):
    """One fresh copy (0%), one with the reference solution restored (100%), and one whose
    minillm kills the process on import (0%, and the grader carries on)."""
    fresh = Path(student_copies["scheduler"]["out"])
    subs = tmp_path / "submissions"
    shutil.copytree(fresh, subs / "alice")
    shutil.copytree(fresh, subs / "bob")
    shutil.copy(REPO / "minillm" / "engine" / "scheduler.py", subs / "bob" / "minillm" / "engine" / "scheduler.py")
    shutil.copytree(fresh, subs / "carol")
    init = subs / "carol" / "minillm" / "__init__.py"
    init.write_text("import os\nos._exit(3)\n" + init.read_text())
    (subs / "not-a-copy").mkdir()
    scores = tmp_path / "scores.csv"
    assert main(["lab", "grade", "scheduler", "--submissions", str(subs), "--csv", str(scores)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: line for line in out if line.split() and line.split()[0] in ("alice", "bob", "carol")}
    assert "0/4 tasks, 0%" in rows["alice"] and "4/4 tasks, 100%" in rows["bob"] and "0/4 tasks, 0%" in rows["carol"]
    assert "stopped early" in rows["carol"]
    table = list(csv.DictReader(scores.open()))
    assert [(r["student"], r["percent"]) for r in table] == [("alice", "0"), ("bob", "100"), ("carol", "0")]
    assert table[1]["budget"] == "1" and table[0]["budget"] == "0"
