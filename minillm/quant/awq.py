"""AWQ (Lin et al. 2023): activation-aware weight quantisation.

Observation: a few input channels carry much larger activations than the rest, and the weights
that multiply them matter most. Keeping 1% of weights in fp16 would protect them, but mixed
precision is awkward in hardware. Instead, scale: for a per-input-channel s > 1,

    W x = (W * s) (x / s)

and quantising W * s shrinks the *relative* rounding error of the salient columns (their
values get larger while the group's step grows less than proportionally). The division x / s is
folded into whatever produced x: the RMSNorm weight before q/k/v and gate/up, or the rows of
w_up before w_down. So the model computes the same function in full precision and runs at
zero extra cost.

Per group of linears that share an input:
    s = mean|x|^alpha (per input channel), normalised by sqrt(max(s) * min(s))
    alpha on the grid 0, 0.05, ..., 0.95; keep the alpha whose *block output* (the whole
    attention / FFN / w_down) with fake-quantised weights is closest (MSE) to full precision.
    alpha = 0 is s = 1, plain RTN: so on calibration data AWQ is never worse than RTN.
Then clipping: for each weight group, try clamping to (1 - i/20) * max|w|, i < 10, and keep the
ratio with the smallest output error of that group (q and k are skipped, as in llm-awq: their
outputs only feed a softmax through q k^T). Finally the weights are RTN-quantised (asymmetric,
group 128 by default).

Not done here: llm-awq also scales v -> o when their shapes match. With GQA (SmolLM2: 3 KV heads
for 9 query heads) w_v has 192 output rows and w_o 576 input columns, so that pair is skipped,
as the reference does too.
"""
from __future__ import annotations

import torch

from . import int4, quantize_linear, replace_module
from .sequential import calibrate_sequentially, capture_inputs

N_GRID = 20                 # alpha in {0, 1/20, ..., 19/20}
MAX_SHRINK = 0.5            # clipping tries max * (1 - i/20) for i < 20 * 0.5
CLIP_TOKENS = 2048          # tokens (evenly strided) used by the clipping search


def awq_scales(x_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """Per-input-channel scales s = mean|x|^alpha, normalised so that max(s) * min(s) = 1."""
    s = x_mean.float().pow(alpha).clamp(min=1e-4)            # (in,)
    return s / (s.max() * s.min()).sqrt()


@torch.no_grad()
def search_scales(x: torch.Tensor, linears, inspect, *, bits: int = 4, group_size: int = 128,
                  symmetric: bool = False, n_grid: int = N_GRID):
    """Grid-search alpha for linears that all read x (..., in); inspect(x) -> the output to
    preserve (attention / FFN / linear output). Returns (best_alpha, best_s (in,), losses per alpha)."""
    reference = inspect(x).float()
    x_mean = x.abs().reshape(-1, x.shape[-1]).float().mean(0)                  # (in,)
    originals = [lin.weight.detach().clone() for lin in linears]
    losses, best = [], (float("inf"), None, None)
    try:
        for i in range(n_grid):
            alpha = i / n_grid
            s = awq_scales(x_mean, alpha)                                      # (in,)
            for lin, w in zip(linears, originals):                             # Q(W s) / s acting on x
                lin.weight.copy_((int4.fake_quantize(w.float() * s, bits, group_size, symmetric) / s).to(w.dtype))
            loss = (inspect(x).float() - reference).pow(2).mean().item()
            losses.append(loss)
            if loss < best[0]:
                best = (loss, alpha, s)
    finally:
        for lin, w in zip(linears, originals):
            lin.weight.copy_(w)
    return best[1], best[2], losses


@torch.no_grad()
def fold_into_norm(norm, linears, s: torch.Tensor) -> None:
    """x_norm / s, W * s: the norm's output shrinks per channel, the linears' columns grow."""
    norm.weight.div_(s.to(norm.weight.dtype))
    for lin in linears:
        lin.weight.mul_(s.to(lin.weight.dtype))


@torch.no_grad()
def fold_into_linear(prev, linear, s: torch.Tensor) -> None:
    """prev's output rows / s, linear's input columns * s (prev's output is linear's input)."""
    prev.weight.div_(s.to(prev.weight.dtype)[:, None])
    if prev.bias is not None:
        prev.bias.div_(s.to(prev.bias.dtype))
    linear.weight.mul_(s.to(linear.weight.dtype))


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                max_shrink: float = MAX_SHRINK, n_grid: int = N_GRID) -> torch.Tensor:
    """Best clipping threshold per (row, group) -> max_val (out, ng), for W (out, in) reading x (n, in)."""
    wg = int4.grouped(w.float(), group_size).transpose(0, 1)                  # (ng, O, G)
    xg = int4.grouped(x.float(), group_size).permute(1, 2, 0)                 # (ng, G, n)
    reference = wg @ xg                                                        # (ng, O, n): each group's share of y
    org_max = wg.abs().amax(-1, keepdim=True)                                 # (ng, O, 1)
    best_err = torch.full(org_max.shape, float("inf"), device=w.device)
    best_max = org_max.clone()
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        clipped = wg.clamp(-max_val, max_val)
        q = int4.fake_quantize(clipped, bits, group_size, symmetric)          # (ng, O, G): G columns, one group
        err = (q @ xg - reference).pow(2).mean(-1, keepdim=True)              # (ng, O, 1)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better, max_val, best_max)
    return best_max[..., 0].T                                                  # (O, ng)


def apply_clip(linear, max_val: torch.Tensor, group_size: int) -> None:
    m = int4.per_column(max_val, group_size, linear.in_features).to(linear.weight.dtype)   # (O, in)
    linear.weight.copy_(torch.maximum(torch.minimum(linear.weight, m), -m))


def stride_tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """(..., in) -> at most n rows, evenly strided, (n, in)."""
    x = x.reshape(-1, x.shape[-1])
    return x[:: max(1, x.shape[0] // n)][:n]


def block_inputs(block, names, h, cos, sin) -> dict[str, torch.Tensor]:
    """Inputs (N, T, in) of the named linears when the block runs on h."""
    inputs = {}
    capture_inputs(block, names, h, cos, sin, lambda name, x: inputs.setdefault(name, []).append(x))
    return {name: torch.cat(xs) for name, xs in inputs.items()}


@torch.no_grad()
def awq_block(block, h, cos, sin, *, bits: int, group_size: int, symmetric: bool, n_grid: int = N_GRID) -> dict:
    """Scale-search and fold, then clip, one transformer block (weights stay float).
    Returns the chosen alpha of each scaled group."""
    kw = dict(bits=bits, group_size=group_size, symmetric=symmetric)
    attn, ffn = block.attn, block.ffn
    x = block_inputs(block, ["attn.wq", "ffn.w_gate", "ffn.w_down"], h, cos, sin)   # full precision
    alphas = {}
    # 1. input channels of q, k, v: scale into attn_norm, judged on the attention output
    alphas["qkv"], s, _ = search_scales(x["attn.wq"], [attn.wq, attn.wk, attn.wv], lambda t: attn(t, cos, sin),
                                        n_grid=n_grid, **kw)
    fold_into_norm(block.attn_norm, [attn.wq, attn.wk, attn.wv], s)
    # 2. gate and up: scale into ffn_norm, judged on the FFN output (the FFN's input is unchanged by 1.)
    alphas["gate_up"], s, _ = search_scales(x["ffn.w_gate"], [ffn.w_gate, ffn.w_up], ffn, n_grid=n_grid, **kw)
    fold_into_norm(block.ffn_norm, [ffn.w_gate, ffn.w_up], s)
    # 3. down: scale into w_up's rows (w_down's input silu(gate) * up is unchanged by 2. in full precision)
    alphas["down"], s, _ = search_scales(x["ffn.w_down"], [ffn.w_down], ffn.w_down, n_grid=n_grid, **kw)
    fold_into_linear(ffn.w_up, ffn.w_down, s)
    # 4. clipping, on the inputs the scaled linears now see (q and k skipped)
    x = block_inputs(block, ["attn.wv", "attn.wo", "ffn.w_gate", "ffn.w_down"], h, cos, sin)
    for name, source in (("attn.wv", "attn.wv"), ("attn.wo", "attn.wo"), ("ffn.w_gate", "ffn.w_gate"),
                         ("ffn.w_up", "ffn.w_gate"), ("ffn.w_down", "ffn.w_down")):
        linear = block.get_submodule(name)
        max_val = search_clip(linear.weight, stride_tokens(x[source], CLIP_TOKENS), **kw)
        apply_clip(linear, max_val, group_size)
    return alphas


@torch.no_grad()
def quantize_model_awq(model, ids: torch.Tensor, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                       n_grid: int = N_GRID, progress: bool = False):
    """AWQ every block in turn (scales, folding, clipping), then RTN-quantise its linears.
    model.awq_alphas records the chosen alphas per block."""
    model.awq_alphas = []

    def quantize_block(_index, block, h, cos, sin):
        model.awq_alphas.append(awq_block(block, h, cos, sin, bits=bits, group_size=group_size,
                                          symmetric=symmetric, n_grid=n_grid))
        for name, linear in list(block.named_modules()):
            if type(linear) is torch.nn.Linear:                  # scaled and clipped: plain RTN from here
                replace_module(block, name, quantize_linear(linear, "int4", bits=bits, group_size=group_size,
                                                            symmetric=symmetric))

    return calibrate_sequentially(model, ids, quantize_block, progress)
