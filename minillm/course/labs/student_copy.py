"""The student copy: the reference repository with one lab's solution regions replaced by stubs.

`python -m minillm lab make kv_cache --out DIR` writes it (see markers.py for what a stub is).
The copy carries what git tracks plus untracked files it does not ignore, less the images under
results/; it must not sit inside the reference, and no solution marker may survive in it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from .hints import hints_by_region
from .markers import Region, leftover_markers, parse_regions, strip_solutions
from .registry import LABS, REPO, LabError, get_lab

# files of the reference that a student copy does not need
EXCLUDE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
EXCLUDE_DIRS = ("results/",)                         # only the images under these are left out


def repo_files(repo: Path = REPO) -> list[str]:
    """Files of a repository that a copy carries: what git tracks plus untracked files it does not
    ignore; without git, a walk that skips the usual build and cache folders."""
    repo = Path(repo)
    try:
        raw = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
        names = sorted({n for n in raw.decode().split("\0") if n})
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints"}
        names = sorted(str(p.relative_to(repo)).replace(os.sep, "/") for p in repo.rglob("*")
                       if p.is_file() and not skip.intersection(p.relative_to(repo).parts)
                       and not p.name.endswith((".pyc", ".gguf")))
    return [n for n in names if (repo / n).is_file() and not (repo / n).is_symlink()]


def find_regions(repo: Path = REPO, lab: str | None = None) -> list[Region]:
    """Every solution region in the repository's Python files (optionally of one lab)."""
    regions = []
    for name in repo_files(repo):
        if name.endswith(".py"):
            regions += parse_regions((Path(repo) / name).read_text(encoding="utf-8"), name)
    unknown = sorted({r.lab for r in regions} - set(LABS))
    if unknown:
        raise LabError(f"solution regions name unknown labs: {', '.join(unknown)} ({[str(r) for r in regions if r.lab in unknown]})")
    return [r for r in regions if lab is None or r.lab == lab]


def make_student_copy(lab: str, out, repo: Path = REPO, force: bool = False, git: bool = False) -> dict:
    """Write a student copy of `repo` for `lab` into `out`; returns {"files", "stubbed", "out"}."""
    lab_obj = get_lab(lab)
    repo, out = Path(repo).resolve(), Path(out).resolve()
    if out.is_relative_to(repo):
        raise LabError(f"--out {out} is inside the reference repository {repo}; choose a folder outside it")
    if repo.is_relative_to(out):
        raise LabError(f"--out {out} contains the reference repository; choose another folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise LabError(f"{out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    files = [n for n in repo_files(repo)
             if not (n.startswith(EXCLUDE_DIRS) and n.lower().endswith(EXCLUDE_SUFFIXES))]
    missing = [f for f in lab_obj.files if f not in files]
    if missing:
        raise LabError(f"lab {lab}: {', '.join(missing)} not found in {repo}")
    hints = hints_by_region(find_regions(repo, lab), lab, repo)
    out.mkdir(parents=True, exist_ok=True)
    stubbed = []
    for name in files:
        src, dst = repo / name, out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".py"):
            text, regions = strip_solutions(src.read_text(encoding="utf-8"), name, lab, hints)
            dst.write_text(text, encoding="utf-8")
            shutil.copymode(src, dst)
            stubbed += regions
        else:
            shutil.copy2(src, dst)
    if not stubbed:
        raise LabError(f"lab {lab}: no '# BEGIN SOLUTION {lab}' region found in {repo}")
    left = leftover_markers(out)
    if left:
        raise LabError(f"solution markers survived in the copy: {', '.join(left[:5])}")
    if git:
        cmd = ["git", "-c", "user.name=minillm lab", "-c", "user.email=lab@minillm.invalid"]
        subprocess.run(["git", "init", "-q", str(out)], check=True)
        subprocess.run(cmd + ["-C", str(out), "add", "-A"], check=True)
        subprocess.run(cmd + ["-C", str(out), "commit", "-q", "-m", f"lab {lab}: student copy"], check=True)
    return {"out": out, "files": len(files), "stubbed": stubbed}
