"""Where each token sits: RoPE and the causal mask, shared by every forward pass.

RoPE (rotary position embedding) rotates each *interleaved* pair (x[2i], x[2i+1]) of a query or
key head by the angle position * theta^(-2i / D), so that the score q . k depends on the two
positions only through their difference. Interleaved pairs are how GGUF stores the q/k rows
(HF-format weights are permuted into this layout by the loader). One frequency table
(rope_frequencies), and the same rotation written two ways:

    apply_rope(x, cos, sin)           real arithmetic on the (even, odd) halves: the baseline
                                      model, the KV cache, and the compiled decode step (Inductor
                                      generates no complex arithmetic)
    apply_rope_complex(x, rotation)   the pairs as complex numbers, ONE multiply by e^{i*angle}
                                      from a RopeTable computed once: the fast batch-1 path and the
                                      model runner, q and k together (lesson 02: fewer small ops)

    (even + i*odd) * (cos + i*sin) = (even*cos - odd*sin) + i*(even*sin + odd*cos)

causal_mask(T, S): the T new queries are the last T of S positions (a prefill after S - T cached
tokens), and query t, at position S - T + t, sees keys 0 .. S - T + t (with a sliding window of W,
the last W of them).
"""
from __future__ import annotations

import math

import torch


ROPE_SCALINGS = ("linear", "llama3", "freq_factors")


def rope_frequencies(head_dim: int, theta: float, device=None, scaling: dict | None = None) -> torch.Tensor:
    """theta^(-2i / head_dim) for i = 0 .. head_dim/2 - 1, fp32 (head_dim/2,): pair i turns by
    position * this; rescaled for a longer context where the model was trained so (scaling)."""
    freqs = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    return freqs if scaling is None else scale_frequencies(freqs, scaling)


def scale_frequencies(freqs: torch.Tensor, scaling: dict) -> torch.Tensor:
    """RoPE scaling (ModelConfig.rope_scaling) applied to the frequencies (D/2,):
    - "linear": every frequency divided by `factor` (positions interpolated);
    - "llama3" (Llama 3.1 / 3.2): frequencies whose wavelength is shorter than
      original_max_position_embeddings / high_freq_factor are kept, those longer than
      original_max_position_embeddings / low_freq_factor divided by `factor`, and the band between
      blended linearly in (original context / wavelength);
    - "freq_factors": frequency i divided by factors[i] (how GGUF files store any such scaling:
      the rope_freqs tensor)."""
    kind = scaling.get("rope_type")
    if kind == "linear":
        return freqs / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        context = scaling["original_max_position_embeddings"]
        wavelength = 2 * math.pi / freqs                                         # (D/2,) positions per turn
        blend = ((context / wavelength - low) / (high - low)).clamp(0.0, 1.0)    # 0: long waves, 1: short
        return blend * freqs + (1 - blend) * freqs / factor
    if kind == "freq_factors":
        return freqs / torch.tensor(scaling["factors"], dtype=freqs.dtype, device=freqs.device)
    raise ValueError(f"RoPE scaling {kind!r} is not supported; allowed: {', '.join(map(repr, ROPE_SCALINGS))}")


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None):
    """cos, sin of shape (..., head_dim // 2) for integer positions (...)."""
    freqs = rope_frequencies(head_dim, theta, positions.device, scaling)         # (hd/2,)
    angles = positions.float()[..., None] * freqs                                # (..., hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) by the angle of their position.
    x: (..., hd); cos, sin broadcast against (..., hd/2), e.g. x (B, H, T, hd) with cos, sin
    (B, 1, T, hd/2) or (T, hd/2). Computed in fp32, returned in x's dtype."""
    xf = x.float()
    x_even, x_odd = xf[..., 0::2], xf[..., 1::2]             # (..., hd/2) each
    rot_even = x_even * cos - x_odd * sin
    rot_odd = x_even * sin + x_odd * cos
    return torch.stack((rot_even, rot_odd), dim=-1).flatten(-2).type_as(x)


class RopeTable:
    """RoPE angles for every position up to max_len, computed once: cos and sin (max_len, D/2) fp32
    (for apply_rope) and the same as unit complex numbers, rotation = cos + i sin (max_len, D/2)
    complex64 (for apply_rope_complex)."""

    def __init__(self, head_dim: int, theta: float, max_len: int, device, scaling: dict | None = None):
        self.cos, self.sin = rope_cos_sin(torch.arange(max_len, device=device), head_dim, theta, scaling)
        self.rotation = torch.complex(self.cos, self.sin)


def apply_rope_complex(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """apply_rope as one complex multiply: x (..., H, D), rotation (..., 1, D/2) complex (rows of
    a RopeTable), broadcast over heads. Computed in fp32, returned in x's dtype."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))       # (..., H, D/2)
    return torch.view_as_real(pairs * rotation).flatten(-2).type_as(x)


def causal_mask(num_queries: int, num_keys: int, device=None, window: int | None = None) -> torch.Tensor:
    """(T, S) bool, True where query t may attend to key s: the T queries are the last T of the
    S positions, so query t sees keys 0 .. S - T + t; with a sliding window of W (Mistral), only
    the last W of them: keys S - T + t - W + 1 .. S - T + t."""
    T, S = num_queries, num_keys
    mask = torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)
    return mask if window is None else mask.triu(diagonal=S - T - window + 1)
