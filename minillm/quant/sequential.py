"""Layer-by-layer calibration, shared by GPTQ and AWQ.

The calibration windows are embedded once; then each transformer block in turn is
(1) handed to the method, which quantises its linears using the block's inputs, and
(2) run on those inputs *with its quantised weights*, giving the next block's inputs.
So block i is calibrated on what block i actually receives at inference: the output of
blocks 0..i-1 already quantised, errors included. Only one block's activations are alive at
a time: (N, T, dim) floats, 9 MB for 8 windows of 512 tokens of SmolLM2.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from minillm.model.positions import rope_cos_sin

SUBLAYER_GROUPS = (("attn.wq", "attn.wk", "attn.wv"), ("attn.wo",), ("ffn.w_gate", "ffn.w_up"), ("ffn.w_down",))


@torch.no_grad()
def run_block(block, h: torch.Tensor, cos, sin, batch: int = 4) -> torch.Tensor:
    """block(h) over (N, T, dim) in chunks of `batch` windows (bounds the attention memory)."""
    return torch.cat([block(h[i:i + batch], cos, sin) for i in range(0, h.shape[0], batch)])


@torch.no_grad()
def capture_inputs(block, names, h: torch.Tensor, cos, sin, on_input: Callable[[str, torch.Tensor], None]) -> torch.Tensor:
    """Run the block on h, calling on_input(name, x) with the input x (n, T, in) of each named
    linear as it is computed. Returns the block's output."""
    def hook(name):
        def pre_hook(_module, args):
            on_input(name, args[0])          # returns None: a pre-hook's return value would replace the input
        return pre_hook

    hooks = [block.get_submodule(name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        return run_block(block, h, cos, sin)
    finally:
        for handle in hooks:
            handle.remove()


@torch.no_grad()
def calibrate_sequentially(model, ids: torch.Tensor, quantize_block: Callable[[int, nn.Module, torch.Tensor, object, object], None],
                           progress: bool = False):
    """quantize_block(index, block, h (N, T, dim), cos, sin) must replace the block's linears in place."""
    N, T = ids.shape
    cos, sin = rope_cos_sin(torch.arange(T, device=ids.device), model.cfg.head_dim, model.cfg.rope_theta,
                            model.cfg.rope_scaling)  # (T, hd/2)
    h = model.embed(ids)                                                # (N, T, dim)
    blocks = list(enumerate(model.layers))
    if progress:
        from tqdm.auto import tqdm
        blocks = tqdm(blocks, desc="calibrating")
    for i, block in blocks:
        quantize_block(i, block, h, cos, sin)
        h = run_block(block, h, cos, sin)                               # through the quantised block
    return model
