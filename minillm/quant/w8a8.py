"""W8A8: int8 weights times int8 activations, summed in int32, rescaled once (lesson 04).

Weight-only formats (int8.py, int4.py) make a decode step read fewer bytes but still multiply in
float: a prefill or a large batch, which is compute-bound, gains nothing. W8A8 quantises the
activations too, at run time, so that the GEMM itself runs on the CPU's integer dot-product units
(VNNI on the AMD EPYC VM, AMX on the Intel Xeon VM):

    weights, once:     s_w[o] = max_i |W[o, i]| / 127        q_w = round(W / s_w)    (per output channel)
    activations, per call: s_x[n] = max_i |x[n, i]| / 127    q_x = round(x / s_x)    (per token, dynamic)
    y[n, o] = s_x[n] * s_w[o] * sum_i q_x[n, i] * q_w[o, i]                          (int32 sum, exact)

The integer sum is exact, so the fast path (torch._int_mm, oneDNN's int8 GEMM) and the reference
(`int_matmul_reference`: the same sum in int64 with plain torch) agree bit for bit; the only error is the
two roundings to int8. A token's scale is set by its largest channel, so one outlier channel (the massive
activations lesson 04 measures) leaves every other channel a few levels of the grid: SmoothQuant
(Xiao et al., 2023) divides each input channel j of x by s_j and multiplies the weights' column j by
s_j, which leaves x @ W^T unchanged and moves the outlier's range into the weights:

    s_j = max|x_j|^alpha / max_o |W[o, j]|^(1 - alpha)       (alpha: the migration strength, 0.5 typical)

The division of x is folded into the RMSNorm weight before the projections (`fold_smoothing`), so it
costs nothing at run time.
"""
from __future__ import annotations

import torch
from torch import nn

from .int4 import FP16_TINY


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, in) float -> (q int8 (N, in), scale fp32 (N, 1)): symmetric, one absmax scale per row (a token's
    activations, or a weight's output channel); -128 is left unused so that the grid is symmetric."""
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / 127).clamp(min=FP16_TINY)          # (N, 1)
    q = torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8)               # (N, in)
    return q, scale


def int_matmul_reference(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """qx (N, in) int8, qw (out, in) int8 -> (N, out) int32: the integer sum in int64, the plain way."""
    return (qx.long() @ qw.long().t()).to(torch.int32)


def int_matmul(qx: torch.Tensor, qw: torch.Tensor) -> torch.Tensor:
    """int_matmul_reference by the library's int8 GEMM (torch._int_mm: int8 x int8 -> int32)."""
    return torch._int_mm(qx, qw.t())


class W8A8Linear(nn.Module):
    """nn.Linear with its weight stored as int8 per output channel and its input quantised per token at run
    time: y = (q_x @ q_w^T) * s_x * s_w^T (+ bias), returned in the input's dtype."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        q, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("q", q)                                    # (out, in) int8
        self.register_buffer("scale", scale[:, 0])                      # (out,) fp32
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor, reference: bool = False) -> torch.Tensor:
        """x (..., in) -> (..., out); reference=True sums by int_matmul_reference (same bits)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"W8A8Linear takes inputs of {self.in_features} features; got shape {tuple(x.shape)}")
        rows = x.reshape(-1, self.in_features)                          # (N, in)
        qx, sx = quantize_rows(rows)                                    # (N, in) int8, (N, 1)
        acc = (int_matmul_reference if reference else int_matmul)(qx, self.q)   # (N, out) int32
        y = acc.float() * sx * self.scale[None, :]
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float = 0.5) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s (in,) for the projections that read one input (q, k, v; or
    gate, up): act_absmax (in,) the largest |x_j| seen in calibration; weights: their (out, in) matrices.
    alpha in [0, 1]: 0 leaves the activations as they are (s = 1 / max|W_j|, all the range on x), 1 moves
    all of it into the weights."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha = {alpha!r}; allowed: a migration strength in [0, 1]")
    w_absmax = torch.stack([w.detach().float().abs().amax(dim=0) for w in weights]).amax(dim=0)   # (in,)
    a = act_absmax.float().clamp(min=FP16_TINY)
    return (a ** alpha / w_absmax.clamp(min=FP16_TINY) ** (1 - alpha)).clamp(min=FP16_TINY)


@torch.no_grad()
def fold_smoothing(norm_weight: torch.Tensor, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """x / s folded into the RMSNorm weight that produces x, and s into each reading projection's columns:
    norm(x) / s @ (W * s)^T = norm(x) @ W^T, so the float model is unchanged (to rounding)."""
    norm_weight.div_(s.to(norm_weight.dtype))
    for linear in linears:
        linear.weight.mul_(s.to(linear.weight.dtype)[None, :])
