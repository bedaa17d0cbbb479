"""Multi-head latent attention (MLA, DeepSeek-V2 §2.1, arXiv 2405.04434; kept in DeepSeek-V3), from scratch.

Every token's keys and values come from one small latent vector c (kv_lora_rank wide) that all heads
share, plus one RoPE key (qk_rope_head_dim wide) that all heads share too. A cache holds only those:

    c, k_rope = RMSNorm(x W_dkv)[:r], rope(x W_dkv[r:])            per token: r + d_rope values, one "head"
    head h:  k_h = [c W_uk_h ; k_rope]      v_h = c W_uv_h         (W_uk_h: r -> d_nope, W_uv_h: r -> d_v)

Two ways to attend, equal up to float rounding (tests/model/test_mla.py):

    naive       expand the latent into every head's K and V (H x (d_nope + d_rope) and H x d_v per
                token), then ordinary attention: what training and a prefill do
    absorbed    never build K or V: q_nope_h . (c W_uk_h) = (q_nope_h W_uk_h^T) . c, so each head's
                query is moved into the latent space once (q_lat_h = q_nope_h W_uk_h^T, r wide) and
                scores come from the cached c directly; the output is a weighting of c's, which
                W_uv_h maps to the head's d_v values afterwards. That is multi-query attention with
                ONE key head of width r + d_rope whose values are its first r columns: what a
                decode step runs over the latent cache (DeepSeek-V2 §2.1.2, "absorbed" into W_q, W_o)

The softmax scale stays 1/sqrt(d_nope + d_rope), the head width of the naive form, in both.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .positions import apply_rope, causal_mask

# DeepSeek's latent RMSNorms (q_a_layernorm, kv_a_layernorm) use their class default, not the config's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAShape:
    """The widths of multi-head latent attention (DeepSeek-V3: 1536, 512, 128, 64, 128). The model's
    head_dim is the RoPE width (qk_rope_head_dim), as in transformers' DeepseekV3Config."""
    q_lora_rank: int | None    # queries through a latent too (None: one projection, DeepSeek-V2-Lite)
    kv_lora_rank: int          # r: the cached latent
    qk_nope_head_dim: int      # each head's key part with no position
    qk_rope_head_dim: int      # the RoPE part, one key shared by all heads
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_width(self) -> int:
        """Values cached per token and layer: the latent and the RoPE key (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def scale(self) -> float:
        return 1 / math.sqrt(self.qk_head_dim)

    def num_parameters(self, dim: int, n_heads: int) -> int:
        q = (dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * n_heads * self.qk_head_dim
             if self.q_lora_rank else dim * n_heads * self.qk_head_dim)
        kv = dim * self.cache_width + self.kv_lora_rank + \
            self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        return q + kv + n_heads * self.v_head_dim * dim


def split_kv_up(w_kv_b: torch.Tensor, shape: MLAShape, n_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W_kv_b (H * (d_nope + d_v), r) -> W_uk (H, d_nope, r), W_uv (H, d_v, r): the per-head up-projections
    of the latent (views, no copy)."""
    w = w_kv_b.view(n_heads, shape.qk_nope_head_dim + shape.v_head_dim, shape.kv_lora_rank)
    return w[:, :shape.qk_nope_head_dim], w[:, shape.qk_nope_head_dim:]


def absorbed_query(q: torch.Tensor, w_uk: torch.Tensor, shape: MLAShape) -> torch.Tensor:
    """q (..., H, d_nope + d_rope), its RoPE part rotated -> (..., H, r + d_rope): the no-position part
    moved into the latent space (q_nope W_uk), the RoPE part kept. Its dot with a cached
    [c ; k_rope] is the naive q . k."""
    q_nope, q_rope = q.split([shape.qk_nope_head_dim, shape.qk_rope_head_dim], dim=-1)
    q_lat = torch.einsum("...hn,hnr->...hr", q_nope, w_uk)                 # (..., H, r)
    return torch.cat([q_lat, q_rope], dim=-1)                              # (..., H, r + d_rope)


def latent_output(o_lat: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_lat (..., H, r), each head's softmax-weighted sum of latents -> (..., H, d_v) by W_uv."""
    return torch.einsum("...hr,hvr->...hv", o_lat, w_uv)


class LatentAttention(nn.Module):
    """MLA with transformers' DeepseekV3Attention's weights (the loader maps the names):
    wq or (wq_a, q_norm, wq_b); wkv_a (dim -> r + d_rope), kv_norm, wkv_b (r -> H (d_nope + d_v)); wo."""

    def __init__(self, cfg):
        super().__init__()
        from .llama import RMSNorm

        s: MLAShape = cfg.mla
        self.shape, self.n_heads = s, cfg.n_heads
        H = cfg.n_heads
        if s.q_lora_rank:
            self.wq_a = nn.Linear(cfg.dim, s.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(s.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(s.q_lora_rank, H * s.qk_head_dim, bias=False)
        else:
            self.wq = nn.Linear(cfg.dim, H * s.qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.dim, s.cache_width, bias=False)
        self.kv_norm = RMSNorm(s.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(s.kv_lora_rank, H * (s.qk_nope_head_dim + s.v_head_dim), bias=False)
        self.wo = nn.Linear(H * s.v_head_dim, cfg.dim, bias=False)

    def queries(self, x, cos, sin):
        """x (B, T, dim) -> q (B, H, T, d_nope + d_rope), the RoPE part rotated."""
        B, T, _ = x.shape
        s = self.shape
        q = self.wq_b(self.q_norm(self.wq_a(x))) if s.q_lora_rank else self.wq(x)
        q = q.view(B, T, self.n_heads, s.qk_head_dim).transpose(1, 2)         # (B, H, T, d_nope + d_rope)
        q_nope, q_rope = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        return torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)

    def latents(self, x, cos, sin):
        """x (B, T, dim) -> what a cache keeps: c (B, T, r) normalised and k_rope (B, T, d_rope) rotated."""
        c, k_rope = self.wkv_a(x).split([self.shape.kv_lora_rank, self.shape.qk_rope_head_dim], dim=-1)
        return self.kv_norm(c), apply_rope(k_rope[:, None], cos, sin)[:, 0]

    def expand(self, c, k_rope):
        """The naive form's K (B, H, S, d_nope + d_rope) and V (B, H, S, d_v) from c (B, S, r), k_rope (B, S, d_rope)."""
        B, S, _ = c.shape
        s, H = self.shape, self.n_heads
        kv = self.wkv_b(c).view(B, S, H, s.qk_nope_head_dim + s.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([s.qk_nope_head_dim, s.v_head_dim], dim=-1)     # (B, H, S, d_nope), (B, H, S, d_v)
        k = torch.cat([k_nope, k_rope[:, None].expand(B, H, S, s.qk_rope_head_dim)], dim=-1)
        return k, v

    def attend_absorbed(self, q, c, k_rope):
        """q (B, H, T, d_nope + d_rope) over cached c (B, S, r), k_rope (B, S, d_rope) -> (B, H, T, d_v)
        without K or V: multi-query attention over one key head [c ; k_rope] whose value is c, every head's
        scores in one GEMM (H x T query rows against the S latents)."""
        w_uk, w_uv = split_kv_up(self.wkv_b.weight, self.shape, self.n_heads)
        q_abs = absorbed_query(q.transpose(1, 2), w_uk, self.shape).transpose(1, 2)   # (B, H, T, r + d_rope)
        keys = torch.cat([c, k_rope], dim=-1)                                 # (B, S, r + d_rope)
        scores = torch.einsum("bhtd,bsd->bhts", q_abs.float(), keys.float()) * self.shape.scale()
        T, S = scores.shape[-2:]
        scores = scores.masked_fill(~causal_mask(T, S, q.device), float("-inf"))
        o_lat = torch.einsum("bhts,bsr->bhtr", scores.softmax(-1), c.float()).type_as(q)   # (B, H, T, r)
        return latent_output(o_lat.transpose(1, 2), w_uv).transpose(1, 2)     # (B, H, T, d_v)

    def forward(self, x, cos, sin, attend, absorbed: bool = False):        # x: (B, T, dim)
        B, T, _ = x.shape
        q = self.queries(x, cos, sin)
        c, k_rope = self.latents(x, cos, sin)
        if absorbed:                                                         # (attend is the naive form's)
            out = self.attend_absorbed(q, c, k_rope)
        else:
            k, v = self.expand(c, k_rope)
            out = attend(q, k, v, causal=True, scale=self.shape.scale())   # (B, H, T, d_v)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class LatentProjections:
    """One MLA layer's projections in the engine (layer.decoder_layer's qkv slot), absorbed for the paged
    latent cache: x (N, dim) -> q (N, H, r + d_rope), k (N, 1, r + d_rope), v (N, 1, r), multi-query
    attention over one latent key head whose values are its first r columns; values(o) maps the attention's
    latent outputs (N, H, r) to each head's (N, H, d_v). w_in: the fused projection of the input
    ([wq_a or wq ; wkv_a], transforms.fuse_projections), wq_b: the query's up-projection (None without a
    query latent), both callables x -> y (what the runner made of the modules)."""

    def __init__(self, attn: LatentAttention, w_in, wq_b=None):
        s = attn.shape
        self.shape, self.n_heads, self.w_in, self.wq_b = s, attn.n_heads, w_in, wq_b
        self.q_norm = attn.q_norm.weight.detach() if s.q_lora_rank else None
        self.kv_norm = attn.kv_norm.weight.detach()
        self.w_uk, self.w_uv = split_kv_up(attn.wkv_b.weight.detach(), s, attn.n_heads)
        # The backends scale scores by 1/sqrt(their key width, r + d_rope); MLA's is 1/sqrt(d_nope + d_rope).
        self.q_scale = s.scale() * math.sqrt(s.cache_width)

    def __call__(self, x: torch.Tensor, rope):
        s, H, N = self.shape, self.n_heads, x.shape[0]
        r = s.kv_lora_rank
        q, kv = self.w_in(x).split([s.q_lora_rank or H * s.qk_head_dim, s.cache_width], dim=-1)
        if self.wq_b is not None:
            q = self.wq_b(F.rms_norm(q, self.q_norm.shape, self.q_norm, LATENT_NORM_EPS))
        q_nope, q_rope = q.view(N, H, s.qk_head_dim).split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        c, k_rope = kv.split([r, s.qk_rope_head_dim], dim=-1)                 # (N, r), (N, d_rope)
        c = F.rms_norm(c, self.kv_norm.shape, self.kv_norm, LATENT_NORM_EPS)
        rotated = rope(torch.cat([q_rope, k_rope[:, None]], dim=1))          # (N, H + 1, d_rope): one rotation
        q_abs = torch.cat([torch.einsum("nhd,hdr->nhr", q_nope, self.w_uk), rotated[:, :H]], dim=-1) * self.q_scale
        k = torch.cat([c, rotated[:, H]], dim=-1)[:, None]                   # (N, 1, r + d_rope)
        return q_abs, k, k[..., :r]

    def values(self, o_lat: torch.Tensor) -> torch.Tensor:
        """(N, H, r) -> (N, H, d_v)."""
        return torch.einsum("nhr,hvr->nhv", o_lat, self.w_uv)
