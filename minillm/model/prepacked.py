"""Weights laid out once for the CPU GEMM library: the engine's batched steps on CPU.

F.linear(x, W) on CPU hands W (out, in) to MKL (fp32) or oneDNN (bf16/fp16), which first copy
it into the blocked layout their micro-kernels read (panels of rows that stay in cache and
vector registers), on EVERY call. At batch 1 that copy is hidden in the time to read W once; at
16 or 48 rows the GEMM reuses each weight 16-48 times and the copy becomes a visible share. The
libraries can keep the blocked copy instead ("prepacking"), which is what Inductor does for a
frozen CPU graph; here it is done by hand, once per engine:

    mkl     torch.ops.mkl._mkl_reorder_linear_weight(W, M)  MKL's packed SGEMM (fp32 only), laid
            out for M rows; a call with another row count runs the ordinary GEMM on W (same bits)
    onednn  torch.ops.mkldnn._reorder_linear_weight(W, M)   oneDNN's blocked layout (fp32, bf16,
            fp16; AMX tiles on CPUs that have them); M only guides the layout, any row count runs it

Which library is faster depends on the CPU: on the AMD EPYC VM oneDNN's fp32 GEMM is more than
twice as fast as MKL's (MKL does not pick its best code for a CPU that is not Intel's; bench
engine-step records both rates). So where both apply (fp32), the engine's build has one explicit
tuning step (`choose_libraries`): each distinct weight shape is timed with both, the faster kept,
and the choice recorded on the runner (`runner.gemm_libraries`). Skipped (tune=False), every shape
takes `default_library`: MKL for fp32, whose packed GEMM gives F.linear's very bits. Nothing is
timed anywhere else, and nothing is remembered between engines.

Under torch.compile (the runner's compiled batched step) the call goes through one custom op,
minillm::prepacked_linear: oneDNN's packed weight is an opaque MKLDNN tensor that Inductor lowers
only as a constant of a frozen graph, so the op hands Inductor an external call it does not open.

The cost: a second copy of every packed weight (the original stays: the batch-1 path and
state_dict read it). Packed once: a weight changed afterwards is not seen (build a new engine).
Measured in results/engine-step.json (bench engine-step, prepacked vs not on the same engine).
"""
from __future__ import annotations

import statistics
import time
from typing import Iterable

import torch

TIMED_CALLS = 7


def libraries_for(weight: torch.Tensor) -> list[str]:
    """The libraries that can prepack this weight here (empty: use F.linear)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad:
        return []
    found = []
    if weight.dtype == torch.float32 and torch._C.has_mkl:
        found.append("mkl")
    if onednn_supports(weight.dtype):
        found.append("onednn")
    return found


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked GEMM runs this dtype on this CPU: fp32 wherever oneDNN is built in;
    bf16 needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, fp16 AVX-512 FP16 or AVX-NE-CONVERT (an AVX2-only
    CPU such as the AMD EPYC 7003 VM has neither, and F.linear runs those weights unpacked)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return dtype == torch.float32


def default_library(weight: torch.Tensor) -> str:
    """The library a weight is prepacked for when nothing is timed: MKL where it applies (fp32: the
    same bits as F.linear), else oneDNN."""
    found = libraries_for(weight)
    if not found:
        raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device} here")
    return found[0]


def library_key(weight: torch.Tensor, rows: int) -> str:
    """What a choice is made for: "dtype (out, in) rows=M" (speed depends on these, not on values)."""
    return f"{str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)} rows={rows}"


def seconds_of_one_call(packed: "PrepackedLinear", x: torch.Tensor) -> float:
    """Wall-clock seconds of one packed(x)."""
    t0 = time.perf_counter()
    packed(x)
    return time.perf_counter() - t0


def faster_library(weight: torch.Tensor, rows: int, libraries: list[str]) -> str:
    """Of `libraries`, the one whose prepacked GEMM at `rows` rows runs this weight faster on a random
    input: each called once untimed, then TIMED_CALLS rounds calling each in turn (the first alternating),
    so that the shared machine's drift during the step hits every library alike; the lowest median wins."""
    x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)              # (M, in)
    packed = {lib: PrepackedLinear(weight, rows, lib) for lib in libraries}
    for p in packed.values():
        p(x)                                                                # warm-up
    seconds = {lib: [] for lib in libraries}
    for r in range(TIMED_CALLS):
        for lib in libraries if r % 2 == 0 else libraries[::-1]:
            seconds[lib].append(seconds_of_one_call(packed[lib], x))
    return min(libraries, key=lambda lib: statistics.median(seconds[lib]))


def choose_libraries(weights: Iterable[torch.Tensor], rows: int, tune: bool = True) -> dict[str, str]:
    """The tuning step, run once when an engine is built: for each distinct dtype and shape among
    `weights` that can be prepacked, the library whose prepacked GEMM at `rows` rows ran faster here
    (tune=True; faster_library), or default_library (tune=False).
    -> {library_key: library}; the runner keeps it and every PrepackedLinear it builds follows it."""
    chosen = {}
    for w in weights:
        w = w.detach()
        key = library_key(w, rows)
        found = libraries_for(w)
        if key in chosen or not found:
            continue
        if tune and len(found) > 1:
            chosen[key] = faster_library(w, rows, found)
        else:
            chosen[key] = default_library(w)
    return chosen


def _packed_gemm(x: torch.Tensor, packed: torch.Tensor, weight: torch.Tensor, rows: int, library: str) -> torch.Tensor:
    """x (N, in) -> (N, out) through the library's packed copy of weight (out, in)."""
    if library == "mkl":
        return torch.ops.mkl._mkl_linear(x, packed, weight, None, rows)
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [None], "")


# The GEMM as an op torch.compile keeps whole (module docstring). Defined with torch.library.Library rather
# than torch.library.custom_op, whose Python wrapper costs several times more per call.
if not hasattr(torch.ops.minillm, "prepacked_linear"):
    _LIBRARY = torch.library.Library("minillm", "FRAGMENT")
    _LIBRARY.define("prepacked_linear(Tensor x, Tensor packed, Tensor weight, int rows, str library) -> Tensor")
    _LIBRARY.impl("prepacked_linear", _packed_gemm, "CompositeExplicitAutograd")
    torch.library.register_fake("minillm::prepacked_linear", lib=_LIBRARY)(
        lambda x, packed, weight, rows, library: x.new_empty(x.shape[0], weight.shape[0]))


class PrepackedLinear:
    """y = x @ weight.T with weight (out, in) prepacked for batches of about `rows` rows."""

    def __init__(self, weight: torch.Tensor, rows: int, library: str):
        """library: "mkl" or "onednn" (choose_libraries picks one per shape)."""
        found = libraries_for(weight)
        if not found:
            raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device} here; "
                             "allowed: fp32 with MKL or oneDNN, bf16/fp16 with oneDNN where this CPU has its "
                             "instructions, on CPU, without grad")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows = {rows!r}; allowed: a positive integer (the expected batch rows)")
        if library not in found:
            raise ValueError(f"library = {library!r} cannot prepack a {weight.dtype} weight here; "
                             f"allowed: {', '.join(map(repr, found))}")
        self.library = library
        self.weight, self.rows = weight.detach(), rows                     # (out, in)
        if self.library == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) -> (N, out)."""
        if torch.compiler.is_compiling():
            return torch.ops.minillm.prepacked_linear(x, self.packed, self.weight, self.rows, self.library)
        return _packed_gemm(x, self.packed, self.weight, self.rows, self.library)


def prepack_or_none(module, rows: int, libraries: dict[str, str]) -> PrepackedLinear | None:
    """A bias-free plain nn.Linear (or a bare weight) prepacked for the library `libraries` (from
    choose_libraries) names for its shape, or None where this cannot be."""
    weight = module if isinstance(module, torch.Tensor) else getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear) and (type(module) is not torch.nn.Linear or module.bias is not None):
        return None
    if weight is None or not libraries_for(weight.detach()):
        return None
    weight = weight.detach()
    return PrepackedLinear(weight, rows, libraries[library_key(weight, rows)])


def lm_head(packed: PrepackedLinear, model, h: torch.Tensor) -> torch.Tensor:
    """model.logits(h) for h (K, dim), through the prepacked tied embedding."""
    return packed(model.norm(h))

