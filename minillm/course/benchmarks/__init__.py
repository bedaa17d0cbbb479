"""Benchmarks, one module each; `python -m minillm bench NAME` runs one.

Each module defines NAME (the CLI name) and run(quick: bool) -> dict (see common.py).
Modules are discovered, so adding a benchmark is adding a file.
"""
from __future__ import annotations

import importlib
import pkgutil


def available() -> dict[str, str]:
    """CLI name -> module name, for every benchmark module in this package."""
    names = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name == "common":
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            names[module.NAME] = module.__name__
    return names


def load(name: str):
    names = available()
    if name not in names:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(sorted(names)) or 'none'}")
    return importlib.import_module(names[name])
