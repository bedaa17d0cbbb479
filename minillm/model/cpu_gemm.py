"""The few-row GEMM over weights in row blocks (cpu_gemm.c), built on first use and called through ctypes.

    y = blocked_gemm(x, blocks)      # x (N, in), blocks (out/R, in, R) -> y (N, out), N = 1 .. any

What the projections of the engine's small steps of 2 to MAX_ROWS rows run on a CPU (decode rows of a few
requests, a speculative verification, a short prompt): the weights stream from memory once for all the rows
(cpu_gemm.c's comment). The blocks are transforms.gemv_blocks' copies; a step of more rows uses the prepacked
library GEMM instead. Where the library cannot be built, kernel() says why and the small step takes one row
only, by the loops Inductor generates (layer.gemv).

The engine calls it as the op minillm::blocked_gemm, inside the compiled step's graph.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from minillm.kernel_support import c_library

SOURCE = Path(__file__).with_name("cpu_gemm.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}     # cpu_gemm.c's F32, BF16
MAX_ROWS = 8                                       # a step of up to this many rows is a small step


def library_path() -> Path:
    return c_library.cache_path(SOURCE)


@functools.cache
def kernel() -> tuple[ctypes.CDLL | None, str | None]:
    """-> (the loaded library, None), or (None, why it could not be built or loaded)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return c_library.load(SOURCE, library_path(), "blocked_gemm", [ptr] * 3 + [ctypes.c_int] + [i64] * 3 + [ctypes.c_int])


def supports(blocks: torch.Tensor) -> bool:
    """blocks is a weight in row blocks the kernel reads: CPU, fp32 or bf16, one cache line per block column."""
    return (blocks.device.type == "cpu" and blocks.dtype in DTYPES and blocks.dim() == 3
            and blocks.shape[2] * blocks.element_size() == 64)


def usable(blocks: torch.Tensor) -> bool:
    """The small step can run its projections here: the kernel takes these blocks and it builds."""
    return supports(blocks) and kernel()[0] is not None


def blocked_gemm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """x (N, in), blocks (out/R, in, R) in one dtype (fp32 or bf16) on CPU -> x @ W.T (N, out) in that dtype,
    summed in fp32."""
    lib, why = kernel()
    if lib is None:
        raise RuntimeError(f"the CPU few-row GEMM kernel is not available here: {why}")
    if not supports(blocks) or x.dim() != 2 or x.dtype != blocks.dtype or x.shape[1] != blocks.shape[1] \
            or x.device.type != "cpu":
        raise ValueError(f"blocked_gemm takes x (N, in) and blocks (out/R, in, R) on CPU in one dtype (fp32 with R = 16 "
                         f"or bf16 with R = 32); got x {x.dtype} {tuple(x.shape)}, blocks {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    return _gemm(x.contiguous(), blocks.contiguous())


def _gemm(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """blocked_gemm without its checks: the op a compiled step calls for every projection of every layer, on blocks
    checked once (usable) and rows its own graph made."""
    B, n_in, R = blocks.shape
    y = x.new_empty(x.shape[0], B * R)                                     # (N, out)
    if kernel()[0].blocked_gemm(blocks.data_ptr(), x.data_ptr(), y.data_ptr(), DTYPES[x.dtype], x.shape[0], B, n_in,
                                torch.get_num_threads()):
        raise MemoryError("cpu_gemm.c could not allocate the fp32 copy of x")
    return y


if not hasattr(torch.ops.minillm, "blocked_gemm"):
    _LIBRARY = torch.library.Library("minillm", "FRAGMENT")
    _LIBRARY.define("blocked_gemm(Tensor x, Tensor blocks) -> Tensor")
    _LIBRARY.impl("blocked_gemm", lambda x, blocks: _gemm(x.contiguous(), blocks), "CompositeExplicitAutograd")
    torch.library.register_fake("minillm::blocked_gemm", lib=_LIBRARY)(
        lambda x, blocks: x.new_empty(x.shape[0], blocks.shape[0] * blocks.shape[2]))


class BlockedLinear:
    """A weight in row blocks as a projection x (N, in) -> (N, out) by the kernel (layer.project calls it): what the
    runner hands the compiled small step where the kernel takes its weights. Inside a compiled graph one row runs
    the loops Inductor generates from layer.gemv instead, which fuse the RMSNorm before the projection into the
    product (a whole one-row step was slower with a kernel call per projection when this was built, on the AMD
    EPYC VM). A plain object, not an nn.Module: Dynamo guards on a module's identity, and every layer has its own."""

    def __init__(self, blocks: torch.Tensor):
        self.blocks = blocks                                             # (out/R, in, R)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1 and torch.compiler.is_compiling():
            from .layer import gemv
            return gemv(self.blocks, x[0])[None]                         # (1, out)
        return torch.ops.minillm.blocked_gemm(x, self.blocks)


class BlockedLinearModule(torch.nn.Module):
    """An nn.Linear as a BlockedLinear (its weight laid out in row blocks, its bias kept), x (..., in) -> (..., out):
    for a module run eagerly one token at a time (the EAGLE head's step), where the library GEMM at one row costs
    several times the weight read."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        from .transforms import gemv_blocks

        (blocks,) = gemv_blocks([weight.detach()])
        self.linear = BlockedLinear(blocks)
        self.bias = None if bias is None else bias.detach()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x.reshape(-1, self.in_features).contiguous()).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def takes(weight: torch.Tensor) -> bool:
    """The kernel can run this weight (out, in) once laid out in row blocks, and it builds here."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and weight.shape[0] % (64 // weight.element_size()) == 0 and kernel()[0] is not None)


def use_blocked_linears(module: torch.nn.Module) -> int:
    """Replace every nn.Linear inside module whose weight the kernel takes by a BlockedLinearModule (a load-time
    transform; the module's outputs change only by summation order) -> how many were replaced."""
    replaced = 0
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear and takes(child.weight):
            setattr(module, name, BlockedLinearModule(child.weight, child.bias))
            replaced += 1
        else:
            replaced += use_blocked_linears(child)
    return replaced
