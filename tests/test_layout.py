"""The import graph: kernels/ depends only on minillm's leaf modules, and those import nothing of minillm.

A leaf (minillm/kernel_args.py: argument checks and constants; minillm/kernel_tuning.py: tile choice by
timing) holds what a Triton kernel shares with the PyTorch code that launches it. The minillm modules that launch a kernel import it inside a function; if a kernel
imported them back at module level, the two would form a cycle that holds only while those
imports stay inside functions, and importing a kernel would import the engine.
"""
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LEAVES = ("minillm.kernel_args", "minillm.kernel_tuning")
KERNELS = sorted(p for p in (REPO / "kernels").glob("*.py") if p.name != "__init__.py")


def imported_modules(path: Path, package: str) -> set[str]:
    """Every module a source file imports, anywhere in it (relative imports resolved against package)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names if not node.module}   # `from . import x`
    return found


def minillm_modules(names: set[str]) -> set[str]:
    return {n for n in names if n == "minillm" or n.startswith("minillm.")}


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda p: p.name)
def test_kernels_import_only_leaf_modules_of_minillm(kernel):
    assert minillm_modules(imported_modules(kernel, "kernels")) <= set(LEAVES)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_modules_import_nothing_of_minillm(leaf):
    path = REPO.joinpath(*leaf.split(".")).with_suffix(".py")
    assert minillm_modules(imported_modules(path, leaf.rsplit(".", 1)[0])) == set()


IMPORT_AND_LIST = """
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
print(" ".join(sorted(m for m in sys.modules if m == "minillm" or m.startswith("minillm."))))
"""


def _minillm_modules_loaded_by(*modules: str) -> set[str]:
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    done = subprocess.run([sys.executable, "-c", IMPORT_AND_LIST, *modules], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(done.stdout.split())


def test_importing_the_leaves_imports_no_other_minillm_module():
    assert _minillm_modules_loaded_by(*LEAVES) == {"minillm", *LEAVES}


def test_importing_a_kernel_does_not_import_the_engine():
    pytest.importorskip("triton")
    kernels = [f"kernels.{p.stem}" for p in KERNELS]
    assert _minillm_modules_loaded_by(*kernels) == {"minillm", *LEAVES}
