"""fp16 or bf16? Where a model's activations sit against each 16-bit format's range.

Both formats spend 16 bits; they split them differently:
    fp16: 5 exponent bits, 10 mantissa bits  -> largest 65504, smallest normal 6.1e-5, ~3 decimal digits
    bf16: 8 exponent bits,  7 mantissa bits  -> fp32's range (largest 3.4e38), ~2 decimal digits
fp16 is more precise inside its range, bf16 cannot overflow where fp32 does not. Whether fp16 is safe
for a model is a measurement: run it in fp32, record the largest and the smallest activations of
every layer, and compare them with fp16's limits; then run it in fp16 and bf16 and count what broke.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from minillm.model.llama import Llama

FP16 = torch.finfo(torch.float16)
BF16 = torch.finfo(torch.bfloat16)


@dataclass
class LayerRange:
    layer: int
    residual_max: float        # max |x| of the residual stream after the block
    ffn_hidden_max: float      # max |silu(gate) * up|, the input of the down projection
    below_fp16_normal: float   # fraction of nonzero residual + ffn values with |x| < fp16's smallest normal


def _record(model: Llama, tokens: torch.Tensor) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor]:
    """One forward with hooks: each block's output and each down projection's input, as float32."""
    seen = [dict() for _ in model.layers]
    hooks = []
    for i, block in enumerate(model.layers):
        hooks.append(block.register_forward_hook(
            lambda m, args, out, i=i: seen[i].__setitem__("residual", out.detach().float())))
        hooks.append(block.ffn.w_down.register_forward_pre_hook(
            lambda m, args, i=i: seen[i].__setitem__("ffn_hidden", args[0].detach().float())))
    try:
        with torch.no_grad():
            logits = model(tokens).float()                   # (B, T, vocab)
    finally:
        for h in hooks:
            h.remove()
    return seen, logits


def _ranges(seen: list[dict[str, torch.Tensor]]) -> list[LayerRange]:
    rows = []
    for i, acts in enumerate(seen):
        both = torch.cat([acts["residual"].flatten(), acts["ffn_hidden"].flatten()]).abs()
        nonzero = both[both > 0]
        rows.append(LayerRange(i, acts["residual"].abs().max().item(), acts["ffn_hidden"].abs().max().item(),
                               (nonzero < FP16.smallest_normal).float().mean().item()))
    return rows


def activation_ranges(model: Llama, tokens: torch.Tensor) -> list[LayerRange]:
    """Per-layer extremes of a float32 forward of `tokens` (B, T)."""
    return _ranges(_record(model, tokens)[0])


@dataclass
class DtypeRun:
    dtype: str
    nonfinite_activations: int    # inf or nan anywhere in the recorded activations or logits (overflow)
    became_zero: int              # nonzero in fp32, exactly zero here: underflow, or cancellation in a sum
    logit_max_abs_err: float      # against the fp32 logits
    logit_rel_err: float          # mean |error| / mean |fp32 logit|
    argmax_agreement: float       # fraction of positions whose top token equals fp32's
    perplexity: float             # of tokens[:, 1:] given the prefix, from these logits


def perplexity_of(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp(mean NLL) of tokens (B, T) under logits (B, T, vocab) predicting the next token."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)             # (B, T-1, vocab)
    nll = -logp.gather(-1, tokens[:, 1:, None]).mean()
    return nll.exp().item()


def _run(name: str, model: Llama, tokens: torch.Tensor, reference) -> DtypeRun:
    """`model` (float32) run in dtype `name`, against the float32 forward `reference`."""
    ref_acts, ref_logits = reference
    acts, logits = reference if name == "float32" else _record(copy.deepcopy(model).to(getattr(torch, name)), tokens)
    nonfinite = int((~torch.isfinite(logits)).sum())
    zeros = 0
    for ref, got in zip(ref_acts, acts):
        for key in ("residual", "ffn_hidden"):
            nonfinite += int((~torch.isfinite(got[key])).sum())
            zeros += int(((ref[key] != 0) & (got[key] == 0)).sum())
    err = (logits - ref_logits).abs()
    finite = torch.isfinite(err)
    return DtypeRun(name, nonfinite, zeros,
                    err[finite].max().item() if finite.any() else float("inf"),
                    (err[finite].mean() / ref_logits.abs().mean()).item() if finite.any() else float("inf"),
                    (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
                    perplexity_of(logits, tokens))


def measure(model: Llama, tokens: torch.Tensor, dtypes=("float32", "bfloat16", "float16")):
    """One float32 forward of `tokens` (B, T) gives the per-layer ranges and the reference that a
    copy of the model in each dtype is compared with: (list[LayerRange], list[DtypeRun])."""
    reference = _record(model, tokens)
    return _ranges(reference[0]), [_run(name, model, tokens, reference) for name in dtypes]


def compare_dtypes(model: Llama, tokens: torch.Tensor, dtypes=("float32", "bfloat16", "float16")) -> list[DtypeRun]:
    """Run a float32 model's copy in each dtype on `tokens` (B, T); compare with float32."""
    return measure(model, tokens, dtypes)[1]


def overflow_scale(ranges: list[LayerRange]) -> float:
    """How many times larger the largest activation could grow before fp16 overflows."""
    return FP16.max / max(max(r.residual_max, r.ffn_hidden_max) for r in ranges)
