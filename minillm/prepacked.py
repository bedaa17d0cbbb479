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
engine-step records both rates). So where both apply (fp32), the first weight of each shape is
timed with both, and that shape keeps the faster (`fastest_library`, once per process; benchmarks
record `chosen_libraries()`).

The cost: a second copy of every packed weight (the original stays: the batch-1 path and
state_dict read it). Packed once: a weight changed afterwards is not seen (build a new engine).
Measured in results/engine-step.json (bench engine-step, prepacked vs not on the same engine).
"""
from __future__ import annotations

import torch

from .benchmarks.common import time_median

TIMED_CALLS = 5
_chosen: dict[str, str] = {}          # "dtype (out, in) rows=M" -> the library timed faster in this process


def libraries_for(weight: torch.Tensor) -> list[str]:
    """The libraries that can prepack this weight here (empty: use F.linear)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad:
        return []
    found = []
    if weight.dtype == torch.float32 and torch._C.has_mkl:
        found.append("mkl")
    if weight.dtype == torch.float16 and not torch.ops.mkldnn._is_mkldnn_fp16_supported():
        return found                                   # oneDNN's fp16 GEMM needs AVX-512 FP16 or AVX-NE-CONVERT
    if weight.dtype in (torch.float32, torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available():
        found.append("onednn")
    return found


def _seconds_per_call(packed: "PrepackedLinear", x: torch.Tensor) -> float:
    return time_median(lambda: packed(x), TIMED_CALLS)                 # after one warm-up call


def fastest_library(weight: torch.Tensor, rows: int) -> str:
    """The library whose prepacked GEMM of this weight's shape and dtype at `rows` rows runs faster
    here, timed once per process and shape on this weight and a random input (speed does not depend on values)."""
    found = libraries_for(weight)
    if not found:
        raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device} here")
    key = f"{str(weight.dtype).removeprefix('torch.')} {tuple(weight.shape)} rows={rows}"
    if key not in _chosen:
        if len(found) == 1:
            _chosen[key] = found[0]
        else:
            x = torch.randn(rows, weight.shape[1], dtype=weight.dtype)   # (M, in)
            _chosen[key] = min(found, key=lambda lib: _seconds_per_call(PrepackedLinear(weight, rows, lib), x))
    return _chosen[key]


def chosen_libraries() -> dict[str, str]:
    """What fastest_library picked in this process, per dtype, shape and rows (benchmarks record it)."""
    return dict(_chosen)


class PrepackedLinear:
    """y = x @ weight.T with weight (out, in) prepacked for batches of about `rows` rows."""

    def __init__(self, weight: torch.Tensor, rows: int, library: str | None = None):
        """library: "mkl", "onednn", or None: the faster one here (fastest_library)."""
        found = libraries_for(weight)
        if not found:
            raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device} here; "
                             "allowed: fp32 with MKL or oneDNN, bf16/fp16 with oneDNN, on CPU, without grad")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows = {rows!r}; allowed: a positive integer (the expected batch rows)")
        if library is not None and library not in found:
            raise ValueError(f"library = {library!r} cannot prepack a {weight.dtype} weight here; "
                             f"allowed: {', '.join(map(repr, found))} or None")
        self.library = library or fastest_library(weight, rows)
        self.weight, self.rows = weight.detach(), rows                     # (out, in)
        if self.library == "mkl":
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, rows)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (N, in) -> (N, out)."""
        if self.library == "mkl":
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, None, self.rows)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


def prepack_or_none(module, rows: int) -> PrepackedLinear | None:
    """A bias-free plain nn.Linear (or a bare weight) prepacked, or None where this cannot be."""
    weight = module if isinstance(module, torch.Tensor) else getattr(module, "weight", None)
    if isinstance(module, torch.nn.Linear) and (type(module) is not torch.nn.Linear or module.bias is not None):
        return None
    if weight is None or not libraries_for(weight.detach()):
        return None
    return PrepackedLinear(weight.detach(), rows)


def lm_head(packed: PrepackedLinear, model, h: torch.Tensor) -> torch.Tensor:
    """model.logits(h) for h (K, dim), through the prepacked tied embedding."""
    return packed(model.norm(h))

