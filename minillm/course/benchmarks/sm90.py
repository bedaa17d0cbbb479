"""The Triton kernels compiled for Hopper (sm_90, the H100's and H200's) on any machine, and what they became.

Triton compiles a kernel to PTX and then, with the ptxas it ships, to a cubin for a named GPU; neither
step needs the GPU. So this CPU can check that every kernel compiles for an H200 in the configurations
the tuners will try, how much shared memory each needs, and read the machine code (SASS, from the
cuobjdump Triton ships too): which loads are vectorised, whether an int->float conversion is left in the
inner loop, how many instructions the loop issues per weight. That is a static count, not a timing:
it says what each SM must issue, and a loop that issues more than the memory can feed is issue-bound.

Arguments are specialised as Triton's launcher specialises them: pointers assumed 16-byte aligned,
integers equal to 1 made constants, integers divisible by 16 marked so (which is what lets the
compiler emit 128-bit loads).
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

SM90 = ("cuda", 90, 32)                       # backend, compute capability, warp size
H100_MAX_SHARED = 227 * 1024                  # bytes of shared memory one block may use on sm_90
DEFAULT_INT = 4096                            # an integer argument not given: a size divisible by 16


def tools_dir() -> Path:
    import triton
    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


def available() -> bool:
    """ptxas and cuobjdump ship with the triton wheel on x86-64 Linux; elsewhere this module cannot run."""
    try:
        return all((tools_dir() / tool).is_file() for tool in ("ptxas", "cuobjdump"))
    except ImportError:
        return False


def compile_for_sm90(fn, pointers: dict[str, str], constexprs: dict[str, object], ints: dict[str, int] | None = None,
                     num_warps: int = 4, num_stages: int = 3, floats: tuple[str, ...] = ()):
    """fn: a @triton.jit kernel (imported without TRITON_INTERPRET); pointers: name -> Triton type ("*fp16");
    constexprs: name -> value; floats: fp32 scalar arguments; ints: name -> a representative value of an
    integer argument (others DEFAULT_INT)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    ints = ints or {}
    signature, attrs, constants = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        elif name in constexprs or ints.get(name, DEFAULT_INT) == 1:
            signature[name] = "constexpr"
            constants[(i,)] = constexprs.get(name, 1)
        else:
            signature[name] = "i32"
            if ints.get(name, DEFAULT_INT) % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*SM90), options=dict(num_warps=num_warps, num_stages=num_stages))


def sass(kernel) -> str:
    """The cubin's machine code, as cuobjdump prints it."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(kernel.asm["cubin"])
        done = subprocess.run([str(tools_dir() / "cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                              timeout=60)
    if done.returncode:
        raise RuntimeError(f"cuobjdump failed: {done.stderr[-500:]}")
    return done.stdout


INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9._]*)([^;]*);")


def main_loop(code: str) -> list[str]:
    """Opcodes (with modifiers) of the last loop in the SASS: from a backward branch's target to the branch."""
    rows = [(int(a, 16), op, rest) for a, op, rest in INSTRUCTION.findall(code)]
    loop = None
    for address, op, rest in rows:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            loop = (int(target.group(1), 16), address)
    if loop is None:
        raise ValueError("no loop (backward branch) in this SASS")
    return [op for address, op, _ in rows if loop[0] <= address <= loop[1]]


def gemv_loop(layout: int, block_n: int = 128, num_warps: int = 4, num_stages: int = 3, mode: int = 1,
              group: int = 128) -> dict:
    """The batch-1 W4A16 GEMV (kernels/w4a16_gemv.py) for a 4096 x 4096 fp16 layer, int4 g128 with zero
    points: its main loop (one tile of BLOCK_N rows x 8 * WORDS columns per iteration), per thread."""
    from kernels.w4a16_gemv import _w4a16_gemv_kernel
    from minillm.kernel_support.args import w4a16_tile_k

    tile = w4a16_tile_k(group)
    kernel = compile_for_sm90(
        _w4a16_gemv_kernel,
        pointers={"X": "*fp16", "WORD": "*i32", "S": "*fp16", "Z": "*u8", "CODE": "*fp32", "OUT": "*fp16"},
        constexprs=dict(GROUP=group, MODE=mode, LAYOUT=layout, BLOCK_M=1, BLOCK_N=block_n, WORDS=tile // 8),
        ints=dict(M=1, stride_sn=1, stride_os=0), num_warps=num_warps, num_stages=num_stages)
    body = main_loop(sass(kernel))
    weights = block_n * tile // (32 * num_warps)                   # one iteration's weights per thread
    ops = Counter(op.split(".")[0] for op in body)
    return {"layout": layout, "block_n": block_n, "num_warps": num_warps, "loop_instructions": len(body),
            "weights_per_thread": weights, "instructions_per_weight": len(body) / weights,
            "opcodes": dict(ops.most_common()), "loads": sorted({op for op in body if op.startswith("LDG")}),
            "int_to_float": sum(op.startswith("I2F") for op in body), "barriers": ops["BAR"],
            "shared_bytes": kernel.metadata.shared}


def unit_strides(fn) -> dict[str, int]:
    """The head-dimension strides (stride_*d) of contiguous attention tensors are 1."""
    return {name: 1 for name in fn.arg_names if name.startswith("stride_") and name[-1] == "d"}


def compile_all(dtype: str = "bf16") -> list[dict]:
    """Every GPU kernel of the repository compiled for sm_90 in the configurations its launcher may pick
    (the tuners' lists, cut to what fits shared memory by the launchers' own estimate), with the shared
    memory each needs against what one block may use on Hopper."""
    import torch

    from kernels import flash_attention as fa
    from kernels import flash_attention_backward as fab
    from kernels import paged_attention as pa
    from kernels import w4a16 as mma
    from kernels import w4a16_gemv as gemv
    from minillm.quant.w4a16 import GEMV_CONFIGS, MATMUL_CONFIGS

    rows, cuda, t = [], torch.device("cuda"), f"*{dtype}"

    def add(name, fn, pointers, constexprs, config, **kw):
        kernel = compile_for_sm90(fn, pointers, constexprs, num_warps=config.get("num_warps", 4),
                                  num_stages=config.get("num_stages", 3), **kw)
        rows.append({"kernel": name, "config": {**constexprs, **config}, "shared_bytes": kernel.metadata.shared,
                     "fits": kernel.metadata.shared <= H100_MAX_SHARED})

    for d in (64, 128):
        for c in fa.fitting_configs(cuda, d, 2):
            add("flash_attention._attn_fwd", fa._attn_fwd, {**dict.fromkeys("QKVO", t), "LSE": "*fp32"},
                dict(GROUP=4, HEAD_DIM=d, BLOCK_D=d, PAD_D=False, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"],
                     CAUSAL=True, UPCAST=False, DOT_PRECISION="tf32"), c, ints=unit_strides(fa._attn_fwd),
                floats=("qk_scale",))
        for c in fab.fitting_configs(cuda, d, 2):
            for name, fn in (("_attn_bwd_dkdv", fab._attn_bwd_dkdv), ("_attn_bwd_dq", fab._attn_bwd_dq)):
                pointers = {n: t for n in ("Q", "K", "V", "DO", "DK", "DV", "DQ") if n in fn.arg_names}
                add(f"flash_attention_backward.{name}", fn, {**pointers, "LSE": "*fp32", "DELTA": "*fp32"},
                    dict(GROUP=4, HEAD_DIM=d, BLOCK_D=d, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], CAUSAL=True,
                         UPCAST=False, DOT_PRECISION="tf32"), c, ints=unit_strides(fn), floats=("sm_scale", "qk_scale"))
        add("paged_attention._paged_decode", pa._paged_decode,
            {**dict.fromkeys(("Q", "K_cache", "V_cache", "O"), t), "Block_tables": "*i32", "Seq_lens": "*i32",
             "O_part": "*fp32", "Lse_part": "*fp32"},
            dict(GROUP=4, BLOCK_G=16, HEAD_DIM=d, BLOCK_D=d, BLOCK_SIZE=16, BLOCK_N=64, NUM_SPLITS=1, UPCAST=False,
                 DOT_PRECISION="tf32"), {"num_warps": 4, "num_stages": 3}, ints=unit_strides(pa._paged_decode),
            floats=("qk_scale",))
    w4 = {"X": "*fp16", "S": "*fp16", "Z": "*u8", "CODE": "*fp32"}
    for c in MATMUL_CONFIGS:
        add("w4a16._w4a16_kernel", mma._w4a16_kernel, {**w4, "P": "*u8", "Y": "*fp16"},
            dict(GROUP=128, MODE=1, BLOCK_M=c["block_m"], BLOCK_N=c["block_n"], BLOCK_K=128, UPCAST=False,
                 DOT_PRECISION="tf32"), c, ints=dict(stride_xk=1, stride_pk=1, stride_yn=1))
    for c in GEMV_CONFIGS:
        for block_m in (1, 8):
            add("w4a16_gemv._w4a16_gemv_kernel", gemv._w4a16_gemv_kernel, {**w4, "WORD": "*i32", "OUT": "*fp32"},
                dict(GROUP=128, MODE=1, LAYOUT=1, BLOCK_M=block_m, BLOCK_N=c["block_n"], WORDS=16), c)
    return rows


def run() -> dict:
    """The GEMV's main loop in each word layout and the tile shapes QuantLinear tunes over
    (minillm/quant/w4a16.py:GEMV_CONFIGS), compiled for sm_90 here."""
    import triton

    from minillm.quant.w4a16 import GEMV_CONFIGS

    shapes = sorted({(c["block_n"], c["num_warps"], c["num_stages"]) for c in GEMV_CONFIGS})
    rows = [gemv_loop(layout, block_n, num_warps, num_stages) for layout in (0, 1)
            for block_n, num_warps, num_stages in shapes]
    best = {layout: min(r["instructions_per_weight"] for r in rows if r["layout"] == layout) for layout in (0, 1)}
    compiled = compile_all()
    return {"name": "w4a16-sm90", "target": "sm_90 (compiled here, not run)", "triton": triton.__version__,
            "kernel": "kernels/w4a16_gemv.py, batch 1, fp16 x, int4 g128 with zero points, 4096 x 4096",
            "results": rows, "compiled": compiled,
            "summary": {"fewest_instructions_per_weight": {f"layout_{k}": v for k, v in best.items()},
                        "kernels_compiled": len(compiled), "all_fit_shared_memory": all(r["fits"] for r in compiled),
                        "most_shared_bytes": max(r["shared_bytes"] for r in compiled)}}


if __name__ == "__main__":              # python -m minillm.course.benchmarks.sm90 results/w4a16-sm90.json
    import os
    import sys

    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    from minillm.course.benchmarks.common import write_json

    print("wrote", write_json(run(), sys.argv[1] if len(sys.argv) > 1 else "results/w4a16-sm90.json"))
