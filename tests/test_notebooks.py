"""Every notebook runs top to bottom on CPU in quick mode (MINILLM_QUICK=1)."""
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("MINILLM_QUICK", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


def test_every_lesson_has_a_notebook():
    lessons = sorted((Path(__file__).parent.parent / "lessons").glob("[0-9][0-9]-*.md"))
    for lesson in lessons:
        number = lesson.name[:2]
        assert any(p.name.startswith(number + "_") for p in NOTEBOOKS), f"{lesson.name} has no notebook"
