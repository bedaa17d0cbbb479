"""The GPU lease's plumbing, on CPU: the model travels in two halves and is joined bit for bit, notebooks
are executed one by one inside a time box into one tar, and the results unpack where they belong."""
import importlib.util
import json
import tarfile
from pathlib import Path

import pytest
import torch

from minillm.course import notebook

ROOT = Path(__file__).parents[2]


def load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_halves_join_to_the_same_bytes(tmp_path, monkeypatch):
    carry, check = load_tool("gpu_carry"), load_tool("gpu_check")
    from minillm.loading.loader import SMOLLM2
    original = tmp_path / "model.gguf"
    original.write_bytes(bytes(range(256)) * 1001 + b"odd")          # an odd length
    keep, carried = tmp_path / "keep", tmp_path / "carried"
    keep.mkdir(), carried.mkdir()
    carry.split_file(original, keep / "model.1", carried / "model.2")
    assert 0 < (keep / "model.1").stat().st_size < original.stat().st_size
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    joined = check.join_model(carried / "model.2", keep)
    assert joined == tmp_path / "cache" / SMOLLM2["file"] and joined.read_bytes() == original.read_bytes()
    with pytest.raises(FileNotFoundError, match="make gpu-carry"):
        check.join_model(carried / "absent", keep)


def test_the_wheel_lists_are_pinned():
    carry = load_tool("gpu_carry")
    call_1, call_2 = (carry.pinned_wheels(carry.LISTINGS[name]) for name in ("wheels", "wheels.2"))
    assert {"nbclient", "nbformat", "ipykernel", "gguf"} <= {w.split("==")[0] for w in call_1}
    assert {"openai", "fastapi", "uvicorn", "pydantic"} <= {w.split("==")[0] for w in call_2}   # notebook 09
    assert all("==" in w for w in call_1 + call_2)
    assert not {w.split("==")[0] for w in call_1} & {w.split("==")[0] for w in call_2}


def test_the_notebook_kernels_get_an_absolute_pythonpath(tmp_path):
    """The kernels start in notebooks/: a "." from the Makefile must not reach them as notebooks/."""
    check = load_tool("gpu_check")
    root = tmp_path / "repo"
    assert check.kernel_pythonpath("/tmp/site:.", root) == f"/tmp/site:{root.resolve()}"
    assert check.kernel_pythonpath(None, root) == str(root)
    assert check.kernel_pythonpath(f"{root}:/x", root) == f"{root}:/x"


def tiny_notebook(path: Path, body: str) -> Path:
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell("from minillm.course.notebook import start\ndevice, QUICK = start()"),
                nbformat.v4.new_code_cell(body)]
    nbformat.write(nb, path)
    return path


def test_notebooks_run_in_full_mode_inside_the_time_box_into_one_tar(tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    check = load_tool("gpu_check")
    monkeypatch.setenv("MINILLM_QUICK", "1")                # the run must not inherit quick mode
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    src = tmp_path / "src"
    src.mkdir()
    good = tiny_notebook(src / "01_good.ipynb", "print('hello from', device)")
    bad = tiny_notebook(src / "02_bad.ipynb", "print('before the error')\nraise RuntimeError('boom')")
    late = tiny_notebook(src / "03_late.ipynb", "print('never')")
    out = tmp_path / "out"
    out.mkdir()
    check.time = FakeClock(check.time, step_s=20)          # each notebook "takes" time; the third finds none
    done = check.execute_notebooks([good, bad, late], out, budget_s=130)
    assert [d["status"].split(":")[0] for d in done] == ["ok", "error", "not run"]
    assert json.loads((out / "notebooks.json").read_text()) == done
    with tarfile.open(out / "notebooks.tar") as tar:
        assert sorted(tar.getnames()) == ["01_good.ipynb", "02_bad.ipynb"]
        tar.extractall(tmp_path / "unpacked")
    assert notebook.produced_on(tmp_path / "unpacked" / "01_good.ipynb").endswith(", cpu, full")
    bad_text = (tmp_path / "unpacked" / "02_bad.ipynb").read_text()
    assert "before the error" in bad_text and "boom" in bad_text     # the outputs up to the error are kept
    assert not (out / "executed").exists()


class FakeClock:
    """time, with perf_counter advancing step_s per call so that a time box is crossed on purpose."""
    def __init__(self, real, step_s: float):
        self._real, self._now, self._step = real, 0.0, step_s

    def perf_counter(self) -> float:
        self._now += self._step
        return self._now

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_unpack_puts_notebooks_and_results_where_they_belong(tmp_path, monkeypatch):
    check = load_tool("gpu_check")
    fake_root = tmp_path / "repo"
    (fake_root / "notebooks").mkdir(parents=True)
    (fake_root / "results" / "gpu").mkdir(parents=True)
    monkeypatch.setattr(check, "ROOT", fake_root)
    lease = tmp_path / "lease"
    lease.mkdir()
    (lease / "x.ipynb").write_text("{}")
    with tarfile.open(lease / "notebooks.tar", "w") as tar:
        tar.add(lease / "x.ipynb", arcname="07_x.ipynb")
    (lease / "w4a16-kernel.json").write_text("{}")
    (lease / "pytest-cuda.log").write_text("ok")
    check.unpack(lease)
    assert (fake_root / "notebooks" / "07_x.ipynb").is_file()
    assert sorted(p.name for p in (fake_root / "results" / "gpu").iterdir()) == ["pytest-cuda.log", "w4a16-kernel.json"]


def test_start_prints_the_machine_line_that_produced_on_reads(capsys, monkeypatch):
    monkeypatch.setenv("MINILLM_QUICK", "1")
    device, quick = notebook.start()
    assert quick and device == ("cuda" if torch.cuda.is_available() else "cpu")
    line = capsys.readouterr().out.strip()
    assert notebook.FIRST_LINE.match(line), line
    with pytest.raises(ValueError, match="allowed"):
        notebook.start("tpu")


def test_steps_share_the_calls_deadline(tmp_path, monkeypatch):
    """Each step's box is cut to what is left of the call; with too little left a step is recorded, not run."""
    check = load_tool("gpu_check")
    monkeypatch.setattr(check, "OUT", tmp_path)
    clock = FakeClock(check.time, step_s=0)
    check.time = clock
    check.deadline = check.Deadline(100)
    assert check.deadline.box(60) == 60
    clock._now += 70
    assert check.deadline.box(60) == 30
    check.step("fits", lambda: {"value": 1}, 60)
    assert json.loads((tmp_path / "fits.json").read_text()) == {"seconds": None, "value": 1}
    clock._now += 25                                                   # 5 s left: under MIN_STEP_S
    ran = []
    check.step("late", lambda: ran.append(1) or {}, 60)
    assert not ran and "deadline" in json.loads((tmp_path / "late.json").read_text())["error"]
    check.run_pytest(["tests/none.py"], "late.log", 60)
    assert "deadline" in (tmp_path / "late.log").read_text()


def test_gpu_steps_pick_the_kernel_steps_to_run(tmp_path, monkeypatch):
    check = load_tool("gpu_check")
    assert check.selected_steps(None) == check.selected_steps("") == check.KERNEL_STEPS
    assert check.selected_steps("pytest-cuda, paged-kernel") == ("pytest-cuda", "paged-kernel")
    with pytest.raises(ValueError, match="allowed: w4a16-kernel"):
        check.selected_steps("pytest")
    monkeypatch.setattr(check, "OUT", tmp_path)
    monkeypatch.setattr(check, "KEEP", tmp_path / "keep")
    monkeypatch.setenv("GPU_STEPS", "paged-kernel")
    check.kernels()                                    # on CPU the step fails for want of CUDA, and says so
    assert [p.name for p in tmp_path.glob("*.json")] == ["paged-kernel.json"]
    assert "error" in json.loads((tmp_path / "paged-kernel.json").read_text())


def test_gpu_notebooks_pick_the_notebooks_to_run():
    check = load_tool("gpu_check")
    everything = check.ordered_notebooks()
    assert [p.name[:2] for p in everything[:3]] == check.NOTEBOOK_ORDER[:3] and len(everything) == 13
    assert [p.name[:2] for p in check.ordered_notebooks(only="07, 02")] == ["02", "07"]    # the run's order
    with pytest.raises(ValueError, match="allowed: 01"):
        check.ordered_notebooks(only="14")
