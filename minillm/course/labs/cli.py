"""The ways in: `python -m minillm lab {list, make, grade}` (minillm/__main__.py adds the parser)
and, for the notebook's self-check cells, self_check.
"""
from __future__ import annotations

from pathlib import Path

from . import grader
from .registry import LABS, REPO, LabError, get_lab
from .report import format_lab_list, format_result, format_row, write_csv
from .student_copy import find_regions, make_student_copy


def self_check(lab: str, quick: bool = False, repo=None) -> grader.LabResult:
    """Grade the repository this minillm was imported from, in this process, and print the score
    (the notebook's self-check cells). quick: only the lab's quick task."""
    lab_obj = get_lab(lab)
    tasks = [lab_obj.quick_task or lab_obj.tasks[0].name] if quick else None
    result = grader.grade(repo or REPO, lab, tasks=tasks, isolated=False, tests_root=Path(repo or REPO))
    print(format_result(result))
    if quick:
        print(f"(quick: {len(result.tasks)} of {len(lab_obj.tasks)} tasks checked; run without MINILLM_QUICK for all)")
    return result


def add_lab_parser(sub) -> None:
    """`python -m minillm lab {list, make, grade}` (called by minillm/__main__.py)."""
    lab = sub.add_parser("lab", help="classroom labs: list them, make a student copy, grade copies")
    lsub = lab.add_subparsers(dest="lab_command", required=True)
    ls = lsub.add_parser("list", help="the labs: name, title, time estimate, number of tasks")
    ls.add_argument("-v", "--verbose", action="store_true", help="also the functions, tasks and target numbers")
    ls.add_argument("--regions", action="store_true", help="also every solution region in this repository")
    ls.set_defaults(func=_cli_list)
    mk = lsub.add_parser("make", help="write a student copy with one lab's solutions replaced by stubs")
    mk.add_argument("lab")
    mk.add_argument("--out", required=True, help="a folder outside this repository")
    mk.add_argument("--force", action="store_true", help="replace --out if it exists")
    mk.add_argument("--git", action="store_true", help="make the copy a fresh git repository (one commit, no history)")
    mk.set_defaults(func=_cli_make)
    gr = lsub.add_parser("grade", help="run a lab's tests against one or more copies and score them",
                         description="Examples: lab grade kv_cache (this folder) | lab grade --repo DIR kv_cache | "
                                     "lab grade kv_cache --repo DIR1 DIR2 --csv scores.csv | "
                                     "lab grade kv_cache --submissions FOLDER --csv scores.csv | lab grade all --repo .")
    gr.add_argument("lab", nargs="?", help="a lab name, or 'all' (every lab, one copy)")
    gr.add_argument("--repo", nargs="+", default=None, help="copies to grade (default: the current folder)")
    gr.add_argument("--submissions", default=None, help="a folder with one copy per student (sub-folders)")
    gr.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    gr.add_argument("--csv", default=None, help="write one row per copy here")
    gr.add_argument("--jobs", type=int, default=1, help="copies graded at the same time (default 1)")
    gr.add_argument("--timeout", type=float, default=grader.DEFAULT_TIMEOUT,
                    help="seconds per copy before it counts as hung")
    gr.add_argument("--tests", action="store_true", help="also list each task's test node ids")
    gr.set_defaults(func=_cli_grade)


def _cli_list(args) -> None:
    print(format_lab_list(args.verbose))
    if args.regions:
        for r in find_regions(REPO):
            print(f"  {r.lab:<18} {r.path}:{r.begin}-{r.end}  {r.function}")


def _cli_make(args) -> None:
    done = make_student_copy(args.lab, args.out, force=args.force, git=args.git)
    lab = get_lab(args.lab)
    print(f"wrote {done['out']}: {done['files']} files; lab {lab.name}: {len(done['stubbed'])} regions stubbed")
    for r in done["stubbed"]:
        print(f"  {r.path}: {r.function}")
    print(f"handout: {lab.handout}; the student checks with: python -m minillm lab grade {lab.name}")


def _cli_grade(args) -> None:
    repos = list(args.repo or [])
    name = args.lab
    if name is None and repos and (repos[-1] in LABS or repos[-1] == "all"):
        name = repos.pop()                                # `lab grade --repo DIR1 DIR2 LAB`
    if name is None:
        raise LabError(f"which lab? one of: {', '.join(LABS)} (or all)")
    if args.submissions:
        repos += [str(p) for p in grader.submissions_in(args.submissions)]
        if not repos:
            raise LabError(f"no sub-folder of {args.submissions} holds a minillm package")
    repos = repos or ["."]
    for r in repos:
        if not Path(r).is_dir():
            raise LabError(f"{r} is not a folder")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if name == "all":
        if len(repos) != 1 or tasks:
            raise LabError("'all' grades every lab of ONE copy, without --tasks")
        results = grader.grade_labs(repos[0], list(LABS), timeout=args.timeout)
        for r in results:
            print(format_result(r, args.tests))
        passed, total = sum(r.n_passed for r in results), sum(r.n_tasks for r in results)
        print(f"all: {passed}/{total} tasks, {round(100 * passed / total) if total else 0}%")
    elif len(repos) == 1:
        results = [grader.grade(repos[0], name, tasks=tasks, timeout=args.timeout)]
        print(format_result(results[0], args.tests))
    else:
        results = grader.grade_many(repos, name, jobs=args.jobs, tasks=tasks, timeout=args.timeout)
        width = max(len(Path(r).resolve().name) for r in repos) + 1
        for r in results:
            print(format_row(r, width))
        mean = sum(r.percent for r in results) / len(results)
        print(f"{len(results)} copies graded on {name}; mean {mean:.0f}%")
    if args.csv:
        print(f"wrote {write_csv(results, args.csv)}")
