"""Load-time transforms of a loaded model: done once, before any request, never inside a step.

fuse_projections: q, k, v come from ONE matrix [wq; wk; wv] and gate, up from ONE [w_gate; w_up], so
a layer runs 2 projections where it ran 5 (fewer kernel calls, longer contiguous reads). The original
modules' weights become views into the fused ones: nothing is copied, and the naive model still runs
on the very same numbers. is_fused says whether that still holds (quantising or replacing a
projection after fusing breaks it); it only looks.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .model import Llama


def fuse_projections(model: Llama) -> Llama:
    """Add attn.wqkv and ffn.w_gate_up (in place); wq/wk/wv/w_gate/w_up become views of them."""
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        if hasattr(attn, "wqkv") and _backs(attn.wqkv, (attn.wq, attn.wk, attn.wv)) \
                and _backs(ffn.w_gate_up, (ffn.w_gate, ffn.w_up)):
            continue                     # fused already (a deepcopy, in contrast, leaves stale copies: fuse again)
        if not all(type(m) is nn.Linear for m in (attn.wq, attn.wk, attn.wv, ffn.w_gate, ffn.w_up)):
            raise ValueError("fuse_projections needs plain nn.Linear projections (not quantised ones)")
        attn.wqkv = _fuse([attn.wq, attn.wk, attn.wv])
        ffn.w_gate_up = _fuse([ffn.w_gate, ffn.w_up])
    return model


def is_fused(model: Llama) -> bool:
    """True while every fused matrix still backs the modules the baseline uses."""
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        if not hasattr(attn, "wqkv") or not hasattr(ffn, "w_gate_up"):
            return False
        for fused, parts in ((attn.wqkv, (attn.wq, attn.wk, attn.wv)), (ffn.w_gate_up, (ffn.w_gate, ffn.w_up))):
            if type(fused) is not nn.Linear or not _backs(fused, parts):
                return False
    return True


def _backs(fused: nn.Module, parts) -> bool:
    """The fused Linear's storage is the one its parts' weights view."""
    storage = fused.weight.untyped_storage().data_ptr()
    return all(type(p) is nn.Linear and p.weight.untyped_storage().data_ptr() == storage for p in parts)


def _fuse(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([l.weight.data for l in linears])                  # (sum out, in)
    bias = None if linears[0].bias is None else torch.cat([l.bias.data for l in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                      device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    row = 0
    for l in linears:                                                     # re-point: views, no copy
        n = l.out_features
        l.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            l.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return fused
