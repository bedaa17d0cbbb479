"""W8A8: int8 weights times int8 activations, summed in int32, rescaled once (lesson 04).

Weight-only formats (int8.py, int4.py) make a decode step read fewer bytes but still multiply in
float: a prefill or a large batch, which is compute-bound, gains nothing. W8A8 quantises the
activations too, at run time, so that the GEMM itself is an int8 one (torch._int_mm; which of the
CPU's integer units it uses, VNNI or AMX, is the library's choice and not checked here):

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

The division of x is folded into the RMSNorm weight before the projections, or into w_up's rows for the
down projection (`smooth_block`, with AWQ's fold functions), so it costs nothing at run time.
"""
from __future__ import annotations

import torch
from torch import nn

from .int4 import FP16_TINY

SMOOTHQUANT_ALPHA = 0.5        # the migration strength SmoothQuant's paper uses for most models, and the best here


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


def linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           reference: bool = False) -> torch.Tensor:
    """x (..., in) float, q (out, in) int8, scale (out, 1) -> (..., out) in x's dtype:
    (q_x @ q^T) * s_x * s^T (+ bias), q_x and s_x the per-token quantisation of x. reference=True sums by
    int_matmul_reference (the same bits). What a QuantLinear of format "w8a8" computes."""
    rows = x.reshape(-1, x.shape[-1])                                   # (N, in)
    qx, sx = quantize_rows(rows)                                        # (N, in) int8, (N, 1)
    acc = (int_matmul_reference if reference else int_matmul)(qx, q)    # (N, out) int32
    y = acc.float() * sx * scale.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])


class StackedW8A8:
    """W8A8 layers that read one input (wq, wk, wv; w_gate, w_up; or one alone) as ONE projection: their int8
    rows and scales stacked along the output dimension, so that the input is quantised once and one int8 GEMM
    runs. The numbers are those of the layers one by one: the token's scale is shared by every layer reading
    it, and each output channel keeps its own scale. A plain callable (the engine's eager and compiled layer
    call it; torch.compile generates the quantisation and the rescale as loops around torch._int_mm).
    x (N, in) -> (N, sum out)."""

    def __init__(self, layers):
        self.q = torch.cat([layer.q for layer in layers])                  # (sum out, in) int8
        self.scale = torch.cat([layer.scale for layer in layers])          # (sum out, 1) fp32

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.q, self.scale)


def quantize(w: torch.Tensor) -> dict:
    """W (out, in) -> {"q": int8 (out, in), "scale": fp32 (out, 1)}: the stored tensors of a "w8a8" QuantLinear."""
    q, scale = quantize_rows(w)
    return {"q": q, "scale": scale}


def smoothing_factors(act_absmax: torch.Tensor, weights: list[torch.Tensor],
                      alpha: float = SMOOTHQUANT_ALPHA) -> torch.Tensor:
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
def smooth_block(block, h, cos, sin, alpha: float = SMOOTHQUANT_ALPHA) -> None:
    """SmoothQuant on one transformer block (weights stay float), from its inputs h (N, T, dim): the input
    channels of q, k, v folded into attn_norm, those of gate and up into ffn_norm, those of down into w_up's
    rows (down reads silu(gate) * up, linear in up), each with the largest |x_j| the block's linears see."""
    from .awq import block_inputs, fold_into_linear, fold_into_norm

    attn, ffn = block.attn, block.ffn
    x = block_inputs(block, ["attn.wq", "ffn.w_gate", "ffn.w_down"], h, cos, sin)         # (N, T, in) each

    def absmax(name):
        return x[name].abs().flatten(0, -2).amax(dim=0)                                   # (in,)

    fold_into_norm(block.attn_norm, [attn.wq, attn.wk, attn.wv],
                   smoothing_factors(absmax("attn.wq"), [attn.wq.weight, attn.wk.weight, attn.wv.weight], alpha))
    fold_into_norm(block.ffn_norm, [ffn.w_gate, ffn.w_up],
                   smoothing_factors(absmax("ffn.w_gate"), [ffn.w_gate.weight, ffn.w_up.weight], alpha))
    fold_into_linear(ffn.w_up, ffn.w_down, smoothing_factors(absmax("ffn.w_down"), [ffn.w_down.weight], alpha))


@torch.no_grad()
def quantize_model_w8a8(model, ids: torch.Tensor | None, alpha: float = SMOOTHQUANT_ALPHA, progress: bool = False):
    """Every linear of model.layers as a "w8a8" QuantLinear; with calibration ids (N, T), each block smoothed
    first (smooth_block, alpha) on the hidden states the quantised blocks before it produce; without, plain W8A8."""
    from . import quantize_linear, replace_module
    from .sequential import calibrate_sequentially

    def quantize_block(_index, block, h, cos, sin):
        if h is not None:
            smooth_block(block, h, cos, sin, alpha)
        for name, module in list(block.named_modules()):
            if type(module) is nn.Linear:
                replace_module(block, name, quantize_linear(module, "w8a8"))

    if ids is None:
        for i, block in enumerate(model.layers):
            quantize_block(i, block, None, None, None)
        return model
    return calibrate_sequentially(model, ids, quantize_block, progress)
