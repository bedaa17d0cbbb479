"""Fast batch-1 decode: the same math as kv_cache.forward_cached with the overhead taken out.

At batch 1 a decode step must stream every weight once (lesson 01's bound); everything else
is overhead: one kernel launch + Python dispatch per small op, per layer. What this adds:

  1. fused projections: q, k, v come from ONE matrix [wq; wk; wv] and gate, up from ONE
     [w_gate; w_up]: 5 GEMVs per layer become 2 (fewer launches, longer contiguous reads);
     the original modules' weights become views into the fused ones, so nothing is copied
     and the naive model still runs on the very same numbers;
  2. fewer small ops: RoPE as ONE complex multiply by a precomputed e^{i*angle} table, for q
     and k together (the interleaved (even, odd) pairs are complex numbers; 3 kernels instead
     of ~18), and RMSNorm as one fused kernel (F.rms_norm) instead of 7 elementwise ones;
  3. attention by torch's fused scaled_dot_product_attention over the valid cache prefix
     (GQA without copying K/V: enable_gqa);
  4. the LM head applied to the last position only;
  5. one-token projections as matrix-vector products (torch.mv): on this CPU the bf16 GEMV
     kernel streams a weight about twice as fast as F.linear with one row (lesson 02 measures it).

Tested token-identical to the baseline in fp32 (tests/test_fast_decode.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .kv_cache import KVCache
from .model import Llama


def fuse_projections(model: Llama) -> Llama:
    """Add attn.wqkv and ffn.w_gate_up (in place); wq/wk/wv/w_gate/w_up become views of them."""
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        if hasattr(attn, "wqkv"):
            continue
        if not all(type(m) is nn.Linear for m in (attn.wq, attn.wk, attn.wv, ffn.w_gate, ffn.w_up)):
            raise ValueError("fuse_projections needs plain nn.Linear projections (not quantised ones)")
        attn.wqkv = _fuse([attn.wq, attn.wk, attn.wv])
        ffn.w_gate_up = _fuse([ffn.w_gate, ffn.w_up])
    return model


def is_fused(model: Llama) -> bool:
    """True while every fused matrix still backs the modules the baseline uses (quantising or
    replacing a projection after fusing makes this False, and the fast path must not be used)."""
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        if not hasattr(attn, "wqkv") or not hasattr(ffn, "w_gate_up"):
            return False
        for fused, parts in ((attn.wqkv, (attn.wq, attn.wk, attn.wv)), (ffn.w_gate_up, (ffn.w_gate, ffn.w_up))):
            if type(fused) is not nn.Linear or not all(type(p) is nn.Linear for p in parts):
                return False
            storage = fused.weight.untyped_storage().data_ptr()
            if any(p.weight.untyped_storage().data_ptr() != storage for p in parts):
                return False
    return True


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


def linear(module: nn.Module, x: torch.Tensor, gemv: bool = True) -> torch.Tensor:
    """module(x); but a single row x (one decode token) through a plain nn.Linear runs as
    torch.mv(W, x): the same product, by a GEMV kernel instead of a GEMM one with M = 1."""
    if gemv and type(module) is nn.Linear and x.numel() == module.in_features:
        y = torch.mv(module.weight, x.reshape(-1))                         # (out,)
        if module.bias is not None:
            y = y + module.bias
        return y.view(*x.shape[:-1], -1)
    return module(x)


def lm_head(model: Llama, h: torch.Tensor, gemv: bool = True) -> torch.Tensor:
    """model.logits(h), with the one-row case as a GEMV (the LM head is the largest matrix)."""
    if gemv and model.lm_head is None and h.numel() == h.shape[-1]:
        return torch.mv(model.embed.weight, model.norm(h).reshape(-1)).view(*h.shape[:-1], -1)
    return model.logits(h)


class RopeTable:
    """RoPE angles for every position up to max_len, computed once, as unit complex numbers:
    rotation = cos + i sin, (max_len, D/2) complex64."""

    def __init__(self, head_dim: int, theta: float, max_len: int, device):
        inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        angles = torch.arange(max_len, device=device, dtype=torch.float32)[:, None] * inv_freq
        self.rotation = torch.complex(angles.cos(), angles.sin())


def _rope(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) pair of x (..., H, D) by its angle: as complex numbers,
    (even + i*odd) * (cos + i*sin) = (even*cos - odd*sin) + i*(even*sin + odd*cos).
    rotation (..., 1, D/2) complex, broadcast over heads. Computed in fp32, returned in x's dtype."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))       # (..., H, D/2)
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """model.RMSNorm's forward as one fused kernel (same math: x / rms(x) * weight)."""
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


@torch.no_grad()
def forward_fast(model: Llama, tokens: torch.Tensor, cache: KVCache, rope: RopeTable,
                 prefill_attention: str = "sdpa", gemv: bool = True) -> torch.Tensor:
    """tokens (1, T) continuing one sequence at cache.lengths[0] -> logits of the last token (1, V).
    Same contract as kv_cache.forward_cached for batch 1 (prefill T > 1 or decode T = 1).
    prefill_attention: "sdpa" (torch's fused attention) or "flash" (lesson 05's FlashAttention,
    used for steps with T > 1; a decode step is one query row and always uses sdpa).
    gemv=False runs one-token projections through F.linear (to measure what item 5 buys)."""
    if prefill_attention not in ("sdpa", "flash"):
        raise ValueError(f"prefill_attention = {prefill_attention!r}; allowed: 'sdpa', 'flash'")
    use_flash = prefill_attention == "flash" and tokens.shape[1] > 1
    if use_flash:
        from .flash_attention import flash_attention
    B, T = tokens.shape
    if B != 1:
        raise ValueError("forward_fast is the batch-1 path; use kv_cache.forward_cached for batches")
    cfg = model.cfg
    Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    start = int(cache.lengths[0])
    end = start + T
    if end > cache.max_len:
        raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {end}")
    rotation = rope.rotation[start:end][None, :, None]                    # (1, T, 1, D/2) complex
    h = model.embed(tokens)                                               # (1, T, dim)
    for i, layer in enumerate(model.layers):
        qkv = linear(layer.attn.wqkv, rms_norm(layer.attn_norm, h), gemv)  # (1, T, (Hq+2Hkv)*D)
        qk, v = qkv.split([(Hq + Hkv) * D, Hkv * D], dim=-1)
        qk = _rope(qk.view(B, T, Hq + Hkv, D), rotation).transpose(1, 2)  # (1, Hq+Hkv, T, D)
        q, k = qk[:, :Hq], qk[:, Hq:]                                     # (1, Hq, T, D), (1, Hkv, T, D)
        cache.k[i, :, :, start:end] = k
        cache.v[i, :, :, start:end] = v.view(B, T, Hkv, D).transpose(1, 2)
        keys, values = cache.k[i, :, :, :end], cache.v[i, :, :, :end]     # (1, Hkv, end, D)
        if use_flash:                                                     # causal with offset start
            out = flash_attention(q, keys, values, causal=True)           # (1, Hq, T, D)
        else:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=T > 1 and start == 0,
                                                 attn_mask=_prefix_mask(start, T, h.device) if T > 1 and start else None,
                                                 enable_gqa=True)         # (1, Hq, T, D)
        h = h + linear(layer.attn.wo, out.transpose(1, 2).reshape(B, T, Hq * D), gemv)
        gate, up = linear(layer.ffn.w_gate_up, rms_norm(layer.ffn_norm, h), gemv).chunk(2, dim=-1)  # (1, T, ffn) each
        h = h + linear(layer.ffn.w_down, F.silu(gate) * up, gemv)
    cache.lengths[0] = end
    return lm_head(model, h[:, -1], gemv)                                 # (1, V)


def _prefix_mask(start: int, T: int, device) -> torch.Tensor:
    """(T, start + T) bool: query t (at position start + t) sees keys 0..start + t."""
    return torch.ones(T, start + T, dtype=torch.bool, device=device).tril(diagonal=start)


@torch.no_grad()
def generate_greedy_fast(model: Llama, prompt: list[int], max_new_tokens: int, gemv: bool = True) -> list[int]:
    """Greedy batch-1 decoding on the fast path (fuses the model's projections if needed)."""
    if not is_fused(model):
        fuse_projections(model)
    device = model.embed.weight.device
    total = len(prompt) + max_new_tokens
    cache = KVCache(model.cfg, 1, total, model.embed.weight.dtype, device)
    rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta, total, device)
    logits = forward_fast(model, torch.tensor([prompt], device=device), cache, rope, gemv=gemv)  # (1, V)
    out = []
    for step in range(max_new_tokens):
        out.append(int(logits.argmax()))
        if step + 1 < max_new_tokens:
            logits = forward_fast(model, torch.tensor([[out[-1]]], device=device), cache, rope, gemv=gemv)
    return out
