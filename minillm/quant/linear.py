"""QuantLinear: a drop-in nn.Linear whose weight is stored packed (weight-only quantisation).

    y = x @ dequantize(W)^T + b       computed in the activation dtype (W8A16 / W4A16)

The weight never exists in full precision between calls. On a GPU a fused kernel
(kernels/w4a16.py) does the unpacking inside the matmul tile loop, so only the packed bytes cross
the memory bus; that is where 4-bit decode gets its speed. On a CPU, torch's packed-weight kernels
do the same for int8 and int (minillm/quant/cpu_kernels.py; cpu_unsupported says why a layer
cannot). forward_reference is the from-scratch definition every fast path is tested against:
unpack W to float, multiply, drop it; on a CPU that is extra work per call, slower than float.

Formats ("fmt") and their stored tensors:
    "int8"  q int8 (out, in), scale fp16 (out, 1)                          minillm/quant/int8.py
    "int"   packed uint8, scale fp16 (out, in/G), [zero uint8], [perm]     minillm/quant/int4.py
            (RTN, GPTQ and AWQ all produce this; bits 3 or 4)
    "nf4"   packed uint8 (out, in/2), absmax fp32 or its 8-bit form         minillm/quant/nf4.py
    "fp8"   bits uint8 (out, in) holding e4m3 values, scale fp16 (out, 1)  minillm/quant/kv_fp8.py's functions
            (weight-only: no FP8 GEMM on a CPU, so the reference path dequantises; a GPU with FP8 tensor
            cores, H100 and later, multiplies in e4m3)
    "w8a8"  q int8 (out, in), scale fp32 (out, 1)                          minillm/quant/w8a8.py
            (W8A8: the activation is quantised too, per token at run time, and the product is an int8 GEMM;
            forward and forward_reference compute that, not F.linear with the dequantised weight)
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import cpu_kernels, int4, int8, nf4, w8a8
from .kv_fp8 import dequantize_kv_fp8
from .w4a16 import supports, w4a16_linear

DEQUANTIZE = {"int8": int8.dequantize, "int": int4.dequantize, "nf4": nf4.dequantize, "w8a8": int8.dequantize,
              "fp8": dequantize_kv_fp8}


class QuantLinear(nn.Module):
    def __init__(self, fmt: str, in_features: int, out_features: int, tensors: dict[str, torch.Tensor],
                 params: dict | None = None, bias: torch.Tensor | None = None):
        super().__init__()
        if fmt not in DEQUANTIZE:
            raise ValueError(f"fmt = {fmt!r} is unknown; allowed: {', '.join(DEQUANTIZE)}")
        self.fmt, self.in_features, self.out_features = fmt, in_features, out_features
        self.params = dict(params or {})               # bits, group_size, block: plain JSON values
        self.tensor_names = tuple(tensors)
        for name, t in tensors.items():
            self.register_buffer(name, t.contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.cpu_unsupported = cpu_kernels.unsupported(self)   # None: a CPU kernel handles this layer
        self.use_cpu_kernel = True                             # False: the reference path (cpu_kernels.reference_path)
        self._cpu_packs = {}                                   # activation dtype -> cpu_kernels.Packed

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, tensors: dict, params: dict | None = None) -> "QuantLinear":
        return cls(fmt, linear.in_features, linear.out_features, tensors, params, linear.bias)

    def quantized_tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.tensor_names}

    def dequantize(self) -> torch.Tensor:
        """W (out, in) float32."""
        return DEQUANTIZE[self.fmt](**self.quantized_tensors(), **self.params)

    def forward(self, x: torch.Tensor) -> torch.Tensor:    # (..., in) -> (..., out)
        if self.fmt == "w8a8":                                # the library's int8 GEMM, or the plain sum
            return w8a8.linear(x, self.q, self.scale, self.bias, reference=not self.use_cpu_kernel)
        if x.is_cuda and _fused_available(self):
            return w4a16_linear(x, self)
        if cpu_kernels.applies(self, x):
            return cpu_kernels.packed_linear(x, self)
        return self.forward_reference(x)

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:    # (..., in) -> (..., out)
        """The definition: F.linear(x, dequantize(W)) in x's dtype (W8A8: its integer product, summed plainly)."""
        if self.fmt == "w8a8":
            return w8a8.linear(x, self.q, self.scale, self.bias, reference=True)
        w = self.dequantize().to(x.dtype)                    # (out, in): exists only for this call
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def weight_bytes(self) -> int:
        """Bytes of the stored weight: codes plus every scale, zero point and permutation."""
        return sum(t.numel() * t.element_size() for t in self.quantized_tensors().values())

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, in={self.in_features}, out={self.out_features}, {self.params}"


def _fused_available(layer: QuantLinear) -> bool:
    """The Triton kernel handles 4-bit int (without act-order perm) and NF4 without double quant."""
    try:
        import kernels.w4a16  # noqa: F401  (needs triton)
    except ImportError:
        return False
    return supports(layer)
