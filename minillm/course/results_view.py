"""Reading a number out of results/*.json or a module, the way the lessons' footnotes and the quiz do.

    summary.ppl.fp32                    a dict key is an attribute
    results(dtype="bfloat16")           a list called with keyword filters: its one matching row
    results.all(part="x")               every matching row
    median(r.tok_s for r in results)    with a few safe helpers (HELPERS)

Used by tests/prose_numbers.py (the number guard) and minillm/course/quiz.py, so a footnote and a quiz answer
read the same JSON the same way. Standard library only.
"""
from __future__ import annotations

import functools
import importlib
import json
import math
import statistics
from pathlib import Path

HELPERS = {"min": min, "max": max, "abs": abs, "round": round, "len": len, "sum": sum,
           "median": statistics.median, "math": math}


class JsonView:
    """Attribute access over parsed JSON; `where` names the path so far, for error messages."""

    def __init__(self, data, where: str):
        self._d, self._where = data, where

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def __getitem__(self, key):
        try:
            return wrap(self._d[key], f"{self._where}[{key!r}]")
        except (KeyError, IndexError, TypeError):
            raise LookupError(f"{self._where} has no {key!r}") from None

    def __call__(self, **where):
        rows = self.all(**where)
        if len(rows) != 1:
            raise LookupError(f"{self._where}({where}) matches {len(rows)} rows, not 1")
        return rows[0]

    def all(self, **where):
        return [wrap(r, f"{self._where}({where})") for r in self._d
                if isinstance(r, dict) and all(r.get(k) == v for k, v in where.items())]

    def __iter__(self):
        return (wrap(x, self._where) for x in self._d)

    def __len__(self):
        return len(self._d)


def wrap(x, where: str):
    return JsonView(x, where) if isinstance(x, (dict, list)) else x


def evaluate(expr: str, *, results: Path | None = None, module: str | None = None) -> int | float:
    """expr over one results JSON file (its top-level keys as names) or in one module's names."""
    if (results is None) == (module is None):
        raise ValueError("give exactly one of results (a JSON path) or module (a module name)")
    if results is not None:
        path = Path(results).resolve()
        scope = {k: wrap(v, k) for k, v in _load(path, path.stat().st_mtime_ns).items()}
    else:
        scope = dict(vars(importlib.import_module(module)))
    value = eval(expr, {"__builtins__": {}}, {**HELPERS, **scope})  # noqa: S307 (the repo's own footnotes)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"`{expr}` is a {type(value).__name__}, not a number")
    return value


@functools.lru_cache(maxsize=64)
def _load(path: Path, mtime_ns: int) -> dict:
    """A results file parsed once per version (the guard reads each file for hundreds of figures)."""
    return json.loads(path.read_text())
