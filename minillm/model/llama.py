"""The naive baseline: a plain Llama forward pass with no cache. It defines "correct".

Every later module (KV cache, GQA kernels, paging, batching, speculative decoding, quantisation)
is proven equal to this file, so it stays short and obvious:

    tokens -> embedding -> 30 x [RMSNorm -> attention (RoPE, GQA) -> + ; RMSNorm -> SwiGLU -> +]
           -> RMSNorm -> tied LM head -> logits

DeepSeek's two changes are a different attention and a different MLP in the same block (ModelConfig.mla:
multi-head latent attention, model/mla.py; ModelConfig.moe: a mixture of experts, model/moe.py).

Each call recomputes attention over the whole sequence: generating n tokens costs O(n^2) work.
RoPE rotates *interleaved* pairs (0,1), (2,3), ... (minillm/model/positions.py, shared by every path).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from .mla import LatentAttention, MLAShape
from .moe import MoE, MoEShape
from .positions import ROPE_SCALINGS, apply_rope, causal_mask, rope_cos_sin


@dataclass
class ModelConfig:
    """A Llama-family shape. No default shape: name one (ModelConfig.named) or read a checkpoint's."""
    vocab_size: int
    dim: int                   # hidden size
    n_layers: int
    n_heads: int               # query heads
    n_kv_heads: int            # key/value heads (GQA: n_heads // n_kv_heads queries share one)
    head_dim: int              # with MLA: the RoPE width (qk_rope_head_dim)
    ffn_dim: int               # SwiGLU inner size (with MoE: of the dense layers before moe.first_dense)
    rope_theta: float
    max_seq_len: int           # positions the model was trained for
    norm_eps: float = 1e-5
    tie_embeddings: bool = True
    qkv_bias: bool = False     # Qwen2 has biases on q, k, v
    qk_norm: bool = False      # Qwen3: RMSNorm over each head of q and k, before RoPE
    sliding_window: int | None = None   # Mistral: each token attends to the last this many (itself included)
    rope_scaling: dict | None = None   # a longer context than trained for (positions.scale_frequencies)
    mla: MLAShape | None = None        # DeepSeek: multi-head latent attention instead of GQA (model/mla.py)
    moe: MoEShape | None = None        # a mixture of experts instead of the MLP (model/moe.py)

    def __post_init__(self):
        if isinstance(self.mla, dict):                   # from to_dict (a saved quantised model's metadata)
            self.mla = MLAShape(**self.mla)
        if isinstance(self.moe, dict):
            self.moe = MoEShape(**self.moe)
        if self.mla is not None and (self.n_kv_heads != self.n_heads or self.head_dim != self.mla.qk_rope_head_dim
                                     or self.qkv_bias or self.qk_norm):
            raise ValueError("an MLA model has n_kv_heads = n_heads, head_dim = mla.qk_rope_head_dim (the RoPE "
                             "width) and no q/k/v biases or QK-norm")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window = {self.sliding_window!r}; allowed: None or an integer >= 1")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") not in ROPE_SCALINGS:
            raise ValueError(f"RoPE scaling {self.rope_scaling.get('rope_type')!r} is not supported; "
                             f"allowed: None, {', '.join(map(repr, ROPE_SCALINGS))}")

    def to_dict(self) -> dict:
        return asdict(self)

    @staticmethod
    def named(name: str) -> "ModelConfig":
        """A published shape by name: "smollm2-135m", "llama3-8b", ... (minillm/model/shapes.py: SHAPES)."""
        from .shapes import SHAPES

        if name not in SHAPES:
            raise ValueError(f"unknown model shape {name!r}; allowed: {', '.join(map(repr, SHAPES))}")
        return SHAPES[name]

    def replace(self, **changes) -> "ModelConfig":
        """A copy with some fields changed (a variant of a named shape: SMOLLM2_135M.replace(n_kv_heads=9))."""
        return replace(self, **changes)

    def num_parameters(self, active: bool = False) -> int:
        """Every weight; active=True: a MoE model's weights one token runs (top_k routed experts of each layer)."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        q = self.n_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.qkv_bias else 0)
        if self.mla is not None:
            attn = self.mla.num_parameters(d, self.n_heads)
        dense = 3 * d * self.ffn_dim
        mlps = sum(self.moe.num_parameters(d, active) if self.moe and self.moe.is_moe_layer(i) else dense
                   for i in range(self.n_layers))
        layers = self.n_layers * (attn + 2 * d + (2 * self.head_dim if self.qk_norm else 0)) + mlps
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + layers + d + head


def tiny_config(**overrides) -> ModelConfig:
    """A random-weight model small enough for unit tests (same code path as SmolLM2, GQA 3:1)."""
    cfg = dict(vocab_size=256, dim=96, n_layers=2, n_heads=6, n_kv_heads=2, head_dim=16,
               ffn_dim=192, rope_theta=10000.0, max_seq_len=512)
    cfg.update(overrides)
    return ModelConfig(**cfg)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):                                   # (..., dim)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def naive_attention_fp32(q, k, v, causal: bool = True, window: int | None = None, scale: float | None = None):
    """softmax(q k^T / sqrt(d)) v with the (T, S) score matrix materialised, computed in fp32
    whatever q's dtype (the definition of right), returned in q's dtype.
    q: (B, Hq, T, hd); k: (B, Hkv, S, hd); v: (B, Hkv, S, hd_v). With S > T the queries are the last T
    positions. window: each query sees only the last `window` keys up to itself (positions.causal_mask);
    scale: instead of 1/sqrt(hd) (MLA's absorbed form, whose q is wider than the head it stands for).
    (attention.flash.naive_attention_in_dtype is the same math in q's own dtype.)"""
    n_rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(n_rep, dim=1)                    # (B, Hq, S, hd): copies for GQA
    v = v.repeat_interleave(n_rep, dim=1)                    # (B, Hq, S, hd)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale              # (B, Hq, T, S)
    if causal:
        mask = causal_mask(*scores.shape[-2:], device=q.device, window=window)   # (T, S)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)                           # (B, Hq, T, S)
    return (probs @ v.float()).type_as(q)                    # (B, Hq, T, hd_v)


def sdpa_attention(q, k, v, causal: bool = True, window: int | None = None, scale: float | None = None):
    """The same attention by torch's fused F.scaled_dot_product_attention (GQA without copying
    K/V). Its is_causal aligns the mask top-left, so queries after a cached prefix (1 < T < S)
    get the explicit causal_mask; one query row sees every key and needs none (unless a sliding
    window hides the oldest)."""
    T, S = q.shape[-2], k.shape[-2]
    windowed = causal and window is not None and window < S
    mask = causal_mask(T, S, q.device, window) if causal and (1 < T < S or windowed) else None   # (T, S) or None
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and 1 < T == S and mask is None,
                                          scale=scale, enable_gqa=True)     # (B, Hq, T, hd_v)


ATTENTION_BACKENDS = ("naive", "sdpa", "flash")


def check_attention_backend(backend: str) -> str:
    """The one check of the attention-backend option (Llama.forward, forward_fast, LLM)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend = {backend!r} is not supported; allowed: 'naive' (the score "
                         f"matrix materialised, fp32), 'sdpa' (torch's fused scaled_dot_product_attention), "
                         f"'flash' (minillm's FlashAttention, lesson 05)")
    return backend


def attention_function(backend: str):
    """attend(q, k, v, causal) for a backend: "naive" materialises the score matrix (above);
    "sdpa" is torch's fused kernel; "flash" is lesson 05's tiled online softmax
    (minillm/attention/flash.py: the Triton kernel where it can run, its PyTorch twin elsewhere)."""
    check_attention_backend(backend)
    if backend == "naive":
        return naive_attention_fp32
    if backend == "sdpa":
        return sdpa_attention
    from minillm.attention.flash import flash_attention

    def flash(q, k, v, causal: bool = True, window: int | None = None, scale: float | None = None):
        if window is not None:
            raise ValueError("attention_backend='flash' has no sliding window; a windowed model (Mistral) "
                             "runs with 'sdpa' or 'naive'")
        if v.shape[-1] != q.shape[-1]:
            raise ValueError("attention_backend='flash' needs values as wide as keys; an MLA model (DeepSeek) "
                             "runs with 'sdpa' or 'naive'")
        return flash_attention(q, k, v, causal, scale)
    return flash


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        self.window = cfg.sliding_window
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def project_qkv(self, x, cos, sin):
        """x (B, T, dim) -> q (B, Hq, T, hd), k and v (B, Hkv, T, hd), RoPE applied to q and k
        (after each head of q and k is RMS-normalised, where the model has QK-norm)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, attend=naive_attention_fp32):  # x: (B, T, dim)
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x, cos, sin)
        out = attend(q, k, v, causal=True, window=self.window)   # (B, Hq, T, hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig, ffn_dim: int | None = None):
        super().__init__()
        ffn_dim = ffn_dim or cfg.ffn_dim
        self.w_gate = nn.Linear(cfg.dim, ffn_dim, bias=False)
        self.w_up = nn.Linear(cfg.dim, ffn_dim, bias=False)
        self.w_down = nn.Linear(ffn_dim, cfg.dim, bias=False)

    def forward(self, x):                                    # (B, T, dim)
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = LatentAttention(cfg) if cfg.mla else Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn = MoE(cfg) if cfg.moe and cfg.moe.is_moe_layer(layer) else FeedForward(cfg)

    def forward(self, x, cos, sin, attend=naive_attention_fp32):  # (B, T, dim)
        x = x + self.attn(self.attn_norm(x), cos, sin, attend)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def logits(self, h):                                     # (B, T, dim) -> (B, T, vocab)
        h = self.norm(h)
        return F.linear(h, self.embed.weight) if self.lm_head is None else self.lm_head(h)

    def forward(self, tokens: torch.Tensor, attention_backend: str = "naive") -> torch.Tensor:
        """tokens (B, T) int64 -> logits (B, T, vocab). Positions are 0..T-1. attention_backend:
        one of ATTENTION_BACKENDS; the default "naive" is the definition of right."""
        attend = attention_function(attention_backend)
        B, T = tokens.shape
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds the model's max_seq_len {self.cfg.max_seq_len}")
        positions = torch.arange(T, device=tokens.device)
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)  # (T, hd/2)
        h = self.embed(tokens)                               # (B, T, dim)
        for layer in self.layers:
            h = layer(h, cos, sin, attend)
        return self.logits(h)


def random_model_on(cfg: ModelConfig, device: str | torch.device, dtype=torch.bfloat16, seed: int = 0) -> Llama:
    """random_model's weights made where they will run: the modules are built on the meta device (no
    memory), then every parameter is allocated on `device` in `dtype` and filled there by a generator
    of that device. A 7B shape in bf16 goes straight onto a GPU without 28 GB of fp32 on the host.
    The values differ from random_model's (another generator); speed does not depend on them."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Llama(cfg)
    model = model.to_empty(device=device).to(dtype)
    gen = torch.Generator(device=device).manual_seed(seed) if device.type != "meta" else None
    with torch.no_grad():
        for b in model.buffers():                            # a MoE router's balance bias starts at zero
            if device.type != "meta":
                b.zero_()
        for name, p in model.named_parameters():
            if device.type == "meta":
                continue
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=gen)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.normal_(0.0, 1 / math.sqrt(p.shape[-1]), generator=gen)
    return model.eval()


def published_model(name: str, device: str | torch.device, dtype=torch.bfloat16, seed: int = 0) -> Llama:
    """A random-weight model of a published shape (shapes.PUBLISHED: "llama2-7b", "llama3-8b",
    "llama3.2-1b"), made on `device` (random_model_on): for speed measurements where a GPU needs a
    model big enough to matter, with no download."""
    from .shapes import PUBLISHED

    if name not in PUBLISHED:
        raise ValueError(f"unknown model shape {name!r}; allowed: {', '.join(map(repr, PUBLISHED))}")
    return random_model_on(PUBLISHED[name], device, dtype, seed)


def random_model(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> Llama:
    """Random weights with a scale that keeps activations O(1) through the layers."""
    gen = torch.Generator().manual_seed(seed)
    model = Llama(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
    return model.to(dtype).eval()
