"""Classroom labs: hand students the library with one technique cut out, then grade what they write.

    registry.py       LABS: per lab the files and functions to write, the tasks and their tests,
                      the time a class needs and the numbers a correct solution reaches
    markers.py        `# BEGIN SOLUTION <lab>` ... `# END SOLUTION` regions and their stubs
    hints.py          each region's hint, from the lab's hint file lessons/labs/hints/NN-<lab>.md
    student_copy.py   `python -m minillm lab make LAB --out DIR`: the repository with LAB stubbed out
    grader.py         `python -m minillm lab grade LAB --repo DIR ...`: each copy in its own pytest run
    pytest_plugin.py  the grading run's recorder (standard library only, loaded by pytest)
    report.py         the lab list, scores per task, one row per copy, CSV
    cli.py            the `lab` subcommands and the notebook's self_check

Handouts: lessons/labs/NN-<lab>.md; hints: lessons/labs/hints/NN-<lab>.md; teacher's guide: lessons/labs/README.md. The package needs only
the standard library (pytest runs in the grading process), so `python -m minillm lab list` is instant.
"""
from .cli import add_lab_parser, self_check
from .grader import (DEFAULT_TIMEOUT, LabResult, TaskResult, grade, grade_labs, grade_many, score_records,
                     submissions_in)
from .hints import hint_file, hints_by_region, read_hints
from .markers import MARKER_RE, Region, leftover_markers, parse_regions, stub_lines, strip_solutions
from .registry import LABS, REPO, Lab, LabError, Task, get_lab
from .report import format_lab_list, format_result, format_row, write_csv
from .student_copy import find_regions, make_student_copy, repo_files

__all__ = ["LABS", "REPO", "DEFAULT_TIMEOUT", "Lab", "Task", "LabError", "LabResult", "TaskResult", "Region",
           "MARKER_RE", "hint_file", "hints_by_region", "read_hints", "get_lab", "parse_regions", "stub_lines", "strip_solutions", "find_regions", "repo_files",
           "leftover_markers", "make_student_copy", "grade", "grade_labs", "grade_many", "score_records",
           "submissions_in", "format_lab_list", "format_result", "format_row", "write_csv", "self_check", "add_lab_parser"]
