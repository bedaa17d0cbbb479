"""Weights laid out once for the CPU GEMM library: the engine's batched steps on CPU.

F.linear(x, W) on CPU hands W (out, in) to MKL (fp32) or oneDNN (bf16/fp16), which first copy
it into the blocked layout their micro-kernels read (panels of rows that stay in cache and
vector registers), on EVERY call. At batch 1 that copy is hidden in the time to read W once; at
16 or 48 rows the GEMM reuses each weight 16-48 times and the copy becomes a visible share. The
libraries can keep the blocked copy instead ("prepacking"), which is what Inductor does for a
frozen CPU graph; here it is done by hand, once per engine:

    fp32   torch.ops.mkl._mkl_reorder_linear_weight(W, M)  MKL's packed SGEMM, laid out for M
           rows; a call with another row count runs the ordinary GEMM on W (same bits either way)
    bf16   torch.ops.mkldnn._reorder_linear_weight(W, M)   oneDNN's blocked layout (AMX tiles on
    fp16   CPUs that have them); M only guides the layout choice, any row count runs blocked

The cost: a second copy of every packed weight (the original stays: the batch-1 path and
state_dict read it). Packed once: a weight changed afterwards is not seen (build a new engine).
Measured in results/engine-step.json (bench engine-step, prepacked vs not on the same engine).
"""
from __future__ import annotations

import torch


def packing_for(weight: torch.Tensor) -> str | None:
    """Which library can prepack this weight here: "mkl", "onednn" or None (use F.linear)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.requires_grad:
        return None
    if weight.dtype == torch.float32 and torch._C.has_mkl:
        return "mkl"
    if weight.dtype in (torch.bfloat16, torch.float16) and torch.backends.mkldnn.is_available():
        return "onednn"
    return None


class PrepackedLinear:
    """y = x @ weight.T with weight (out, in) prepacked for batches of about `rows` rows."""

    def __init__(self, weight: torch.Tensor, rows: int):
        self.library = packing_for(weight)
        if self.library is None:
            raise ValueError(f"cannot prepack a {weight.dtype} weight on {weight.device} here; "
                             "allowed: fp32 with MKL, bf16/fp16 with oneDNN, on CPU, without grad")
        if not isinstance(rows, int) or rows < 1:
            raise ValueError(f"rows = {rows!r}; allowed: a positive integer (the expected batch rows)")
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
    if weight is None or packing_for(weight.detach()) is None:
        return None
    return PrepackedLinear(weight.detach(), rows)


def lm_head(packed: PrepackedLinear, model, h: torch.Tensor) -> torch.Tensor:
    """model.logits(h) for h (K, dim), through the prepacked tied embedding."""
    return packed(model.norm(h))

