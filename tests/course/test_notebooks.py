"""Every notebook's source is a percent-format script (notebooks/NN_topic.py, `# %%` cells) that builds the
committed notebook (tools/nb.py, jupytext) and runs top to bottom with plain `python` on CPU in quick mode
(MINILLM_QUICK=1), and every equality it prints holds: tokens it says are identical are, values it computes
two ways agree. The committed notebooks are not rewritten."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.course import notebook

FOLDER = Path(__file__).parents[2] / "notebooks"
NOTEBOOKS = sorted(FOLDER.glob("*.ipynb"))
SCRIPTS = sorted(FOLDER.glob("[0-9][0-9]_*.py"))

# Printed booleans "<label>: True" (or "<label>=True"): each label must appear, and be True every time.
PRINTED_SAME = {
    "01_where_time_goes.ipynb": ("hand count == roofline",),
    "02_kv_cache.ipynb": ("identical", "fast path == cached baseline", "same tokens as the baseline"),
    "04_quantization.ipynb": ("same packed bytes", "same dequantised row"),
    "05_flash_attention.ipynb": ("same (m, l, acc) as flash_attention.online_softmax_steps",),
    "06_paged_kv.ipynb": ("same block tables", "same slots", "identical tokens"),
    "07_continuous_batching.ipynb": ("first three requests identical to running alone", "same tokens",
                                     "tokens identical", "same schedule"),
    "08_speculative_decoding.ipynb": ("identical",),
    "09_serving.ipynb": ("same text",),
    "11_parallelism.ipynb": ("column slices side by side == unsplit hidden", "sum of partial products == x W^T",
                             "counted == formula", "same", "same tokens"),
    "12_sglang_ideas.ipynb": ("same hits as by hand", "identical tokens with none / hash / radix",
                              "same allowed tokens as the library", "same allowed tokens as walking each token",
                              "valid"),
    "13_deepseek.ipynb": ("same tokens as transformers", "v is a view of it", "same experts as the library"),
}
# Printed differences between two computations of the same value: (pattern with the number, bound).
# fp32 throughout: the bounds are rounding, far below any real disagreement.
PRINTED_CLOSE = {
    "07_continuous_batching.ipynb": ((r"max \|logit difference\| = (\S+)", 5e-4),),
    "03_gqa.ipynb": ((r"max \|difference\| = (\S+)", 1e-5),
                     (r"max \|logit difference\| vs transformers = (\S+)", 2e-4)),
    "04_quantization.ipynb": ((r"twin vs dequantise-then-matmul: max \|diff\| = (\S+)", 1e-4),),
    "11_parallelism.ipynb": ((r"rank \d: .* max \|difference\| = (\S+)", 1e-5),),
    "13_deepseek.ipynb": ((r"max \|difference\| = (\S+)", 1e-5),),
    "05_flash_attention.ipynb": ((r"max \|flash - autograd\(naive\)\| = (\S+)", 1e-4),
                                 (r"two tiles by hand vs \S+: max \|diff\| = (\S+)", 1e-5)),
}
# Two printed lines that must show the same digits (a backreference to the first line's values).
PRINTED_TWICE = {
    "05_flash_attention.ipynb": (r"online : O = acc / l = (?P<o>\S+) +LSE = m \+ log\(l\) = (?P<lse>\S+)\n"
                                 r"direct : O = (?P=o) +LSE = (?P=lse)\n",),
}


def printed(nb) -> str:
    """Everything the code cells wrote to stdout, in order."""
    return "".join("".join(o.get("text", "")) for c in nb["cells"] if c["cell_type"] == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout")


def check_printed_equalities(name: str, text: str) -> None:
    for label in PRINTED_SAME.get(name, ()):
        said = re.findall(rf"{re.escape(label)}[:=] ?(True|False)\b", text)
        assert said, f"{name} no longer prints '{label}: <bool>'"
        assert all(s == "True" for s in said), f"{name}: {label}: {said}"
    for pattern, bound in PRINTED_CLOSE.get(name, ()):
        values = [float(v) for v in re.findall(pattern, text)]
        assert values, f"{name} no longer prints {pattern!r}"
        assert max(values) <= bound, f"{name}: {pattern!r} gave {values}, bound {bound}"
    for pattern in PRINTED_TWICE.get(name, ()):
        assert re.search(pattern, text), f"{name}: the two lines of {pattern!r} disagree or are missing"


# The longest first (each script's quick run timed alone), so that the kernels running at a time finish together.
LONGEST_FIRST = ("02", "08", "12", "11", "07", "09", "06", "03", "10", "01", "13", "05", "04")


def run_script(path):
    """-> (what `python notebooks/NN_topic.py` printed to stdout, its stderr, its exit code); in notebooks/,
    as a notebook's kernel runs."""
    done = subprocess.run([sys.executable, path.name], cwd=path.parent, capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(FOLDER.parent), *sys.path])})
    return done.stdout, done.stderr, done.returncode


@pytest.fixture(scope="module")
def executed():
    """Every notebook's script run in quick mode, each in its own process, up to three at a time (as many as the
    available memory holds: kernels_that_fit) with ONE torch thread each (OMP_NUM_THREADS=1): on two cores one
    script's imports, compiles, single-threaded Python and waits on its subprocesses overlap the others'. Two
    threads each oversubscribe the cores (the OpenMP threads wait on each other), which made running two at a
    time slower, not faster. Nothing here times anything that is checked: quick mode's printed timings are not
    asserted."""
    from concurrent.futures import ThreadPoolExecutor

    order = sorted(SCRIPTS, key=lambda p: LONGEST_FIRST.index(p.name[:2]) if p.name[:2] in LONGEST_FIRST else -1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MINILLM_QUICK", "1")
        mp.setenv("MPLBACKEND", "Agg")
        mp.setenv("OMP_NUM_THREADS", "1")
        with ThreadPoolExecutor(max_workers=kernels_that_fit()) as pool:
            return dict(zip([p.name for p in order], pool.map(run_script, order)))


KERNEL_BYTES = 4 << 30          # room for one notebook's process: the real model, an engine, a peer model


def kernels_that_fit(most: int = 3) -> int:
    """How many notebook scripts run at once: up to `most`, as many as the memory available now holds
    (a full suite's process has grown by then; a fresh-clone run was killed for memory with three)."""
    meminfo = dict(line.split(":", 1) for line in open("/proc/meminfo")) if Path("/proc/meminfo").exists() else {}
    available = int(meminfo.get("MemAvailable", f"{most * KERNEL_BYTES // 1024} kB").split()[0]) * 1024
    return max(1, min(most, available // KERNEL_BYTES))


def test_every_notebook_is_built_from_its_percent_script():
    """Same cells, same order, same sources: what `python tools/nb.py notebooks/NN_topic.py` builds."""
    jupytext = pytest.importorskip("jupytext")
    nbformat = pytest.importorskip("nbformat")
    assert [p.stem for p in SCRIPTS] == [p.stem for p in NOTEBOOKS]
    for script in SCRIPTS:
        built = jupytext.read(script, fmt="py:percent")
        committed = nbformat.read(script.with_suffix(".ipynb"), as_version=4)
        assert [(c.cell_type, c.source) for c in built.cells] == [(c.cell_type, c.source) for c in committed.cells], \
            f"{script.name} and {script.with_suffix('.ipynb').name} differ: rebuild with tools/nb.py"


@pytest.mark.slow                                       # the notebooks load the real model
@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_notebook_script_runs_with_python_in_quick_mode_and_its_equalities_hold(path, executed):
    stdout, stderr, code = executed[path.name]
    assert code == 0, stderr[-3000:]
    check_printed_equalities(path.with_suffix(".ipynb").name, stdout)


def test_the_equality_checks_read_the_committed_outputs_and_can_fail():
    """The patterns match what the committed notebooks print, and a False or a gap fails them."""
    nbformat = pytest.importorskip("nbformat")
    names = {p.name for p in NOTEBOOKS}
    for name in {*PRINTED_SAME, *PRINTED_CLOSE, *PRINTED_TWICE}:
        assert name in names, name
        check_printed_equalities(name, printed(nbformat.read(NOTEBOOKS[0].parent / name, as_version=4)))
    with pytest.raises(AssertionError, match="same tokens"):
        check_printed_equalities("07_continuous_batching.ipynb", "first three requests identical to running "
                                 "alone: True\nsame tokens: False\npreemptions: 4, tokens identical: True\n")
    with pytest.raises(AssertionError, match="difference"):
        check_printed_equalities("03_gqa.ipynb", "9 query heads / 3 KV heads: max |difference| = 2.0e-01\n")
    with pytest.raises(AssertionError, match="disagree"):
        check_printed_equalities("05_flash_attention.ipynb", "online : O = acc / l = 24.711486   LSE = m + "
                                 "log(l) = 3.440190\ndirect : O = 24.711487   LSE = 3.440190\n"
                                 "dq: max |flash - autograd(naive)| = 1e-07\n"
                                 "same (m, l, acc) as flash_attention.online_softmax_steps: True\n"
                                 "two tiles by hand vs softmax: max |diff| = 2.4e-07\n")


def test_every_lesson_has_a_notebook():
    lessons = sorted((Path(__file__).parents[2] / "lessons").glob("[0-9][0-9]-*.md"))
    for lesson in lessons:
        number = lesson.name[:2]
        assert any(p.name.startswith(number + "_") for p in NOTEBOOKS), f"{lesson.name} has no notebook"


def readme_notebook_machines(readme: str, heading: str) -> dict[str, str]:
    """A README's learning-path table: lesson number -> its last column, where the notebook's outputs come from."""
    text = (Path(__file__).parents[2] / readme).read_text()
    table = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in table.splitlines() if re.match(r"\| \d\d \|", line)]
    return {cells[0].strip(): cells[-1].strip() for cells in rows}


@pytest.mark.parametrize("readme, heading", [("README.md", "## Learning path"), ("README.zh.md", "## 学习路线")])
def test_readme_names_the_machine_that_produced_each_committed_notebook(readme, heading):
    """Read from each notebook's first printed line (minillm.course.notebook.start), so that a notebook committed
    from a CPU run is never presented as a GPU's."""
    said = readme_notebook_machines(readme, heading)
    for path in NOTEBOOKS:
        assert said.get(path.name[:2]) == notebook.produced_on(path), f"{readme}: {path.name}"


def test_produced_on_refuses_a_notebook_without_the_machine_line(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(1)", outputs=[nbformat.v4.new_output("stream", text="1\n")])]
    nbformat.write(nb, tmp_path / "x.ipynb")
    with pytest.raises(ValueError, match="machine line"):
        notebook.produced_on(tmp_path / "x.ipynb")


def test_notebooks_build_on_the_library_not_on_benchmark_internals():
    """A notebook shows its idea with the public API and the module it teaches, never a benchmark's helpers."""
    reading = [p.name for p in SCRIPTS if re.search(r"minillm\.course\.benchmarks|minillm\.course import benchmarks",
                                                    p.read_text(encoding="utf-8"))]
    assert reading == []
