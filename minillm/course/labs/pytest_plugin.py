"""The pytest plugin of a grading run: keep only the selected tests, record every outcome.

Each record is one JSON line, appended and flushed at once, so a run that dies half-way still
leaves what it did. The plugin imports only the standard library, neither minillm nor anything of
the copy being graded. A copy graded in its own process has its own minillm first on sys.path, so
the grader copies this file (the reference's) next to the run and loads it with `pytest -p`: a
plugin imported from the copy would let the copy grade itself. In-process grading (a notebook's
self-check) imports it as minillm.course.labs.pytest_plugin and registers a Recorder itself.

State: a Recorder holds one run's selectors and records; pytest's plugin manager owns it for
that run. The module keeps nothing.
"""
import json
import os
import re
import sys


def compile_selector(selector):
    """A task's selector as a pattern over node ids: '*' matches any text, and a selector also
    matches the parametrised cases of a test and everything inside a class or file."""
    body = ".*".join(re.escape(part) for part in selector.split("*"))
    return re.compile(body + r"(?:\[.*\]|::.*)?", re.S)


def message_of(report):
    """Why a test failed or was skipped, cut to 600 characters."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return crash.message[:600]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])[:600]                   # a skip: (path, line, reason)
    return str(report.longrepr)[-600:]


class Recorder:
    """Deselects every test no selector matches; records collection problems, outcomes and which
    minillm and kernels the tests imported (the grader checks they are the copy's)."""

    def __init__(self, selectors, out_path=None):
        self.patterns = [compile_selector(s) for s in selectors]
        self.out_path = out_path
        self.records = []

    def emit(self, record):
        self.records.append(record)
        if self.out_path:
            with open(self.out_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def pytest_collection_modifyitems(self, session, config, items):
        keep = [i for i in items if any(p.fullmatch(i.nodeid) for p in self.patterns)]
        drop = [i for i in items if i not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
        self.emit({"kind": "collected", "nodeids": [i.nodeid for i in keep]})

    def pytest_collectreport(self, report):
        if report.failed or report.skipped:
            self.emit({"kind": "collect", "nodeid": report.nodeid, "outcome": report.outcome,
                       "message": message_of(report)})

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.emit({"kind": "test", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                       "message": "" if report.outcome == "passed" else message_of(report)})

    def pytest_sessionfinish(self, session, exitstatus):
        origins = {name: getattr(sys.modules.get(name), "__file__", None) for name in ("minillm", "kernels")}
        self.emit({"kind": "finish", "exitstatus": int(exitstatus), "origins": origins})


def pytest_configure(config):
    """Loaded with `-p` in a grading process: record into $MINILLM_LAB_REPORT, with the selectors
    the grader wrote next to it (the same path + '.json')."""
    path = os.environ.get("MINILLM_LAB_REPORT")
    if path and not config.pluginmanager.has_plugin("minillm_lab_recorder"):
        with open(path + ".json", encoding="utf-8") as f:
            selectors = json.load(f)
        config.pluginmanager.register(Recorder(selectors, path), "minillm_lab_recorder")
