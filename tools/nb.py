"""Build a notebook from its percent-format script (jupytext) and execute it, so that it carries a real run's outputs.

    python tools/nb.py notebooks/03_gqa.py              # writes notebooks/03_gqa.ipynb, executed
    python tools/nb.py notebooks/03_gqa.py --no-exec    # the cells only

The script is the source: `# %%` starts a code cell, `# %% [markdown]` a markdown one, and `python
notebooks/03_gqa.py` runs the same code without Jupyter. The kernel starts in notebooks/, as a reader's does.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

KERNEL = {"name": "python3", "display_name": "Python 3", "language": "python"}


def build(script: Path, execute: bool = True, timeout: int = 1800) -> Path:
    nb = jupytext.read(script, fmt="py:percent")
    nb.metadata = {"kernelspec": KERNEL}
    if execute:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(script.parent)}}).execute()
    out = script.with_suffix(".ipynb")
    nbformat.write(nb, out)
    return out


if __name__ == "__main__":
    print("wrote", build(Path(sys.argv[1]), execute="--no-exec" not in sys.argv))
