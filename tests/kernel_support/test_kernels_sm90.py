"""The W4A16 GEMV compiled for Hopper (sm_90) here, without a GPU (minillm/course/benchmarks/sm90.py), and its
main loop read back from the machine code: the codes arrive in 128-bit loads, no int->float conversion
is issued per code (only the tile's zero point converts), and the interleaved word layout issues fewer
instructions per weight than the stored one. Compiling needs the kernels imported without
TRITON_INTERPRET, so each check runs in a fresh interpreter."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minillm.course.benchmarks import sm90

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not sm90.available(), reason="this triton wheel ships no ptxas / cuobjdump")


def compiled(expression: str):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"import json, warnings; warnings.simplefilter('ignore'); from minillm.course.benchmarks import sm90; " \
           f"print(json.dumps({expression}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gemv_main_loop_on_sm90_loads_wide_converts_no_code_and_interleaving_saves_instructions():
    stored, interleaved = compiled("[sm90.gemv_loop(0), sm90.gemv_loop(1)]")
    for loop in (stored, interleaved):
        assert "LDG.E.128" in loop["loads"]                      # 4 words = 32 codes per load
        assert loop["int_to_float"] == 1                         # the zero point, once per tile and row
        assert loop["opcodes"]["FFMA"] >= loop["weights_per_thread"]   # one multiply-add per weight at least
    assert interleaved["instructions_per_weight"] < stored["instructions_per_weight"]
    assert "LDG.E.64" in interleaved["loads"] and "LDG.E.64" not in stored["loads"]   # x in vectors, or strided
    assert interleaved["instructions_per_weight"] < 6.5


def test_the_committed_counts_are_what_this_triton_compiles():
    """results/w4a16-sm90.json (quoted by lesson 04) against a fresh compile of its best configuration."""
    doc = json.loads((REPO / "results" / "w4a16-sm90.json").read_text())
    import triton
    if doc["triton"] != triton.__version__:
        pytest.skip(f"the file was compiled by triton {doc['triton']}, this is {triton.__version__}")
    best = min((r for r in doc["results"] if r["layout"] == 1), key=lambda r: r["instructions_per_weight"])
    again = compiled(f"sm90.gemv_loop(1, {best['block_n']}, {best['num_warps']})")
    assert again["loop_instructions"] == best["loop_instructions"]


def test_every_kernel_compiles_for_sm90_in_every_configuration_its_launcher_may_pick():
    """What the interpreter cannot show: each kernel lowers to Hopper machine code, in each tile configuration
    the tuners time, within the shared memory one block may use (a tile that did not fit would only fail on
    the GPU, and cost a run)."""
    rows = compiled("sm90.compile_all()")
    kernels = {r["kernel"] for r in rows}
    assert {"flash_attention._attn_fwd", "flash_attention_backward._attn_bwd_dkdv", "flash_attention_backward._attn_bwd_dq",
            "paged_attention._paged_decode", "w4a16._w4a16_kernel", "w4a16_gemv._w4a16_gemv_kernel"} <= kernels
    too_big = [(r["kernel"], r["config"], r["shared_bytes"]) for r in rows if not r["fits"]]
    assert not too_big
