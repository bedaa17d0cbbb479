"""The import graph: kernels/ depends only on minillm's leaf modules, and those import nothing of minillm.

A leaf (minillm/kernel_support/args.py: argument checks and constants; minillm/kernel_support/tuning.py: tile choice by
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
LEAVES = ("minillm.kernel_support.args", "minillm.kernel_support.tuning")
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
    assert _minillm_modules_loaded_by(*LEAVES) == {"minillm", "minillm.kernel_support", *LEAVES}


def test_importing_a_kernel_does_not_import_the_engine():
    pytest.importorskip("triton")
    kernels = [f"kernels.{p.stem}" for p in KERNELS]
    assert _minillm_modules_loaded_by(*kernels) == {"minillm", "minillm.kernel_support", *LEAVES}


# The library and the course: minillm/course/ (benchmarks, figures, quiz, notebook helpers, result views, the
# demo, the labs) drives the library; the library never imports it back. Only the command line reaches both.
COURSE = "minillm.course"
CLI = REPO / "minillm" / "__main__.py"


def test_no_library_module_imports_the_course():
    offenders = []
    for path in sorted((REPO / "minillm").rglob("*.py")):
        rel = path.relative_to(REPO)
        if rel.parts[1] == "course" or path == CLI:
            continue
        package = ".".join(rel.with_suffix("").parts[:-1])
        names = imported_modules(path, package)
        offenders += [f"{rel}: {n}" for n in sorted(names) if n == COURSE or n.startswith(COURSE + ".")]
    assert not offenders, offenders


def test_importing_and_running_the_library_loads_no_course_module():
    code = ("import sys\nfrom minillm import LLM, SamplingParams\nfrom minillm.model.llama import random_model, tiny_config\n"
            "class Tok:\n    eos_token_id = 2\n    def decode(self, ids, skip_special_tokens=True): return str(ids)\n"
            "llm = LLM(model=random_model(tiny_config(), seed=0), tokenizer=Tok(), max_model_len=64, enforce_eager=True)\n"
            "out = llm.generate([{'prompt_token_ids': [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)\n"
            "assert len(out[0].outputs[0].token_ids) == 3\n"
            "print(' '.join(m for m in sys.modules if m.startswith('minillm')))\n")
    env = dict(os.environ, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", "1"))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = set(done.stdout.split())
    assert {"minillm.llm", "minillm.engine.engine", "minillm.model.runner"} <= loaded       # the library did run
    course = {m for m in loaded if m == COURSE or m.startswith(COURSE + ".")}
    assert not course, course


def map_paths(readme: str) -> list[tuple[str, str]]:
    """(lesson, path) for every file or folder the README's learning-path table names in its module, kernel and
    tests columns; a path without a top folder is relative to the last top folder named before it in its cell."""
    import re
    found = []
    for line in (REPO / readme).read_text(encoding="utf-8").splitlines():
        if not re.match(r"\| (0[1-9]|1[0-2]) \|", line):
            continue
        cells = line.strip().strip("|").split("|")
        for cell in (cells[2], cells[3], cells[5]):
            top = ""
            for token in re.findall(r"`([^`]+)`", cell):
                if token.split("/")[0] in ("minillm", "kernels", "tests"):
                    top = token.split("/")[0]
                    found.append((cells[0].strip(), token))
                elif token.endswith((".py", "/")):
                    found.append((cells[0].strip(), f"{top}/{token}" if top else token))
    return found


@pytest.mark.parametrize("readme", ["README.md", "README.zh.md"])
def test_every_path_in_the_readme_map_exists(readme):
    paths = map_paths(readme)
    assert len(paths) > 30
    missing = [(lesson, p) for lesson, p in paths if not list(REPO.glob(p.rstrip("/")))]
    assert not missing, missing


PROSE = ["README.md", "README.zh.md", "lessons/**/*.md", "notebooks/*.py", "tools/*.py", "minillm/**/*.py",
         "kernels/*.py"]
NAMED_PATH = r"(?<![\w/.-])((?:minillm|kernels|tests|tools|lessons|notebooks)/[\w/.*-]*[\w*/])"
NOT_OURS = {"tests/test_functional.py",                  # bitsandbytes' tests, cited by lesson 04 and lab 03
            "tests/samplers/test_rejection_sampler.py",  # vLLM's, cited by lab 09
            "minillm/joined"}                            # a key in torch.distributed's store (parallel/workers.py)


def test_every_repository_path_named_in_prose_and_code_exists():
    """A moved module leaves no stale path behind: every `minillm/...`, `tests/...` (and the other top folders')
    path written in the READMEs, lessons, notebook sources, code and tests names something that exists."""
    import re
    missing = []
    for pattern in PROSE:
        for doc in sorted(REPO.glob(pattern)):
            for no, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
                for path in re.findall(NAMED_PATH, line):
                    path = path.rstrip("/.")
                    if path in NOT_OURS or "/NN" in path:       # NN: a lesson or lab number in a pattern
                        continue
                    if "{" in path or not any(REPO.glob(path)):
                        missing.append(f"{doc.relative_to(REPO)}:{no}: {path}")
    assert not missing, "\n".join(missing[:40])
