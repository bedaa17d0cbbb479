"""KV cache: keep every layer's keys and values so decode computes one new position per step.

Without a cache (minillm/model/llama.py) step t recomputes K and V for all t previous tokens:
generating n tokens costs O(n^2) projections. With it, each step projects only the new token,
writes its K/V into a preallocated buffer and attends over the stored ones.

The cache is contiguous and preallocated, one buffer per layer of shape (B, Hkv, max_len, D),
with a length per sequence, so prompts of different lengths can share a batch. Its size is the
article's formula (minillm/course/calculators.py: kv_cache_bytes). Paging (minillm/kvcache/block_manager.py)
removes the waste of reserving max_len for every sequence.

forward_cached() runs the *same* modules as the baseline (model.layers[i].attn.wq, ...);
what is new is marked  # NEW: cache.
"""
from __future__ import annotations

import torch

from minillm.attention.gqa import grouped_attention
from minillm.model.llama import Llama, ModelConfig
from minillm.model.positions import rope_cos_sin
from minillm.perf.roofline import decode_bytes_per_step, decode_flops_per_token
from minillm.perf.timing import time_median


class KVCache:
    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype=torch.float32, device="cpu"):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)   # (L, B, Hkv, max_len, D)
        self.v = torch.zeros(shape, dtype=dtype, device=device)   # (L, B, Hkv, max_len, D)
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)  # (B,) tokens stored
        self.max_len = max_len

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """k, v (B, Hkv, T, D) for positions (B, T): scattered along the sequence axis."""
        # BEGIN SOLUTION kv_cache
        index = positions[:, None, :, None].expand_as(k)           # (B, Hkv, T, D)
        self.k[layer].scatter_(2, index, k)
        self.v[layer].scatter_(2, index, v)
        # END SOLUTION

    def truncate(self, lengths: torch.Tensor) -> None:
        """Forget positions >= lengths (B,): used to roll back rejected speculative tokens."""
        self.lengths = torch.minimum(self.lengths, lengths)


@torch.no_grad()
def forward_cached(model: Llama, tokens: torch.Tensor, cache: KVCache, num_new: torch.Tensor | None = None,
                   all_logits: bool = False) -> torch.Tensor:
    """Run tokens (B, T) that continue each sequence at position cache.lengths[b].

    num_new (B,): how many of the T tokens are real for each sequence (right padding beyond);
    defaults to all T. Returns logits (B, T, V) if all_logits, else the logits of each sequence's
    last real token (B, V). Advances cache.lengths by num_new.
    """
    B, T = tokens.shape
    cfg = model.cfg
    if cfg.sliding_window is not None:
        raise ValueError("a sliding-window model (Mistral) runs on the engine (LLM); this contiguous cache is "
                         "the teaching stage before windows")
    if num_new is None:
        num_new = torch.full((B,), T, dtype=torch.long, device=tokens.device)
    if cache.k.shape[2] != cfg.n_kv_heads or cache.k.shape[0] != cfg.n_layers:
        raise ValueError(f"KV cache was built for {cache.k.shape[0]} layers x {cache.k.shape[2]} KV heads; "
                         f"the model has {cfg.n_layers} x {cfg.n_kv_heads}")
    start = cache.lengths                                                # (B,)
    if int((start + T).max()) > cache.max_len:
        raise ValueError(f"KV cache holds {cache.max_len} positions; this step needs {int((start + T).max())}")
    # BEGIN SOLUTION kv_cache
    positions = start[:, None] + torch.arange(T, device=tokens.device)   # (B, T)
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)   # (B, T, D/2)
    cos, sin = cos[:, None], sin[:, None]                                # (B, 1, T, D/2)
    S = int((start + T).max())                                           # keys to look at
    key_pos = torch.arange(S, device=tokens.device)
    mask = (key_pos[None, None, :] <= positions[:, :, None])[:, None]   # (B, 1, T, S) causal
    # END SOLUTION
    h = model.embed(tokens)                                              # (B, T, dim)
    for i, layer in enumerate(model.layers):
        x = layer.attn_norm(h)
        q, k, v = layer.attn.project_qkv(x, cos, sin)                    # (B, H, T, D)
        # BEGIN SOLUTION kv_cache
        cache.write(i, k, v, positions)                                  # NEW: cache
        keys, values = cache.k[i, :, :, :S], cache.v[i, :, :, :S]        # NEW: (B, Hkv, S, D)
        # END SOLUTION
        out = grouped_attention(q, keys, values, mask)                   # (B, Hq, T, D)
        h = h + layer.attn.wo(out.transpose(1, 2).reshape(B, T, -1))
        h = h + layer.ffn(layer.ffn_norm(h))
    # BEGIN SOLUTION kv_cache
    cache.lengths = start + num_new
    # END SOLUTION
    if all_logits:
        return model.logits(h)                                           # (B, T, V)
    last = h[torch.arange(B, device=h.device), num_new - 1]              # (B, dim)
    return model.logits(last)                                            # (B, V)


@torch.no_grad()
def generate_greedy(model: Llama, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy decoding of a batch of prompts (any lengths) with one shared cache."""
    B = len(prompts)
    device = model.embed.weight.device
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lengths.max())
    cache = KVCache(model.cfg, B, T + max_new_tokens, model.embed.weight.dtype, device)
    tokens = torch.zeros(B, T, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        tokens[b, :len(p)] = torch.tensor(p)
    logits = forward_cached(model, tokens, cache, num_new=lengths)       # prefill: (B, V)
    out = [[] for _ in range(B)]
    for step in range(max_new_tokens):
        nxt = logits.argmax(-1)                                          # (B,)
        for b in range(B):
            out[b].append(int(nxt[b]))
        if step + 1 < max_new_tokens:
            logits = forward_cached(model, nxt[:, None], cache)          # decode: (B, V)
    return out


@torch.no_grad()
def generate_greedy_naive(model: Llama, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The baseline: recompute the whole sequence for every new token."""
    device = model.embed.weight.device
    ids = torch.tensor([prompt], device=device)
    out = []
    for _ in range(max_new_tokens):
        nxt = int(model(ids)[0, -1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, ids.new_tensor([[nxt]])], dim=1)
    return out


# ---- measurements of this stage (bench kv-cache, notebook 02) -------------------------------------

def _random_ids(model, shape: tuple[int, int], seed: int) -> torch.Tensor:
    """Token ids in [3, vocab) on the model's device (a GPU run feeds a CUDA model)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.cfg.vocab_size, shape, generator=gen).to(model.embed.weight.device)


def step_latency(model, position: int, cached: bool) -> float:
    """Seconds for the token at `position`: one forward of position+1 tokens, or one cached step
    (on the model's device; a GPU is synchronised before each clock read)."""
    device = model.embed.weight.device
    ids = _random_ids(model, (1, position + 1), seed=0)                  # (1, position+1)
    if not cached:
        return time_median(lambda: model(ids), repeats=3, device=device)
    cache = KVCache(model.cfg, 1, position + 1, model.embed.weight.dtype, device=device)
    forward_cached(model, ids[:, :position], cache)

    def one_step():
        forward_cached(model, ids[:, position:], cache)
        cache.truncate(cache.lengths - 1)
    return time_median(one_step, repeats=5, device=device)


def prefill_decode(model, batch: int, prompt_len: int, decode_steps: int) -> dict:
    cfg = model.cfg
    dtype, device = model.embed.weight.dtype, model.embed.weight.device
    elem = torch.tensor([], dtype=dtype).element_size()
    ids = _random_ids(model, (batch, prompt_len), seed=1)               # (batch, prompt_len)

    def prefill():
        forward_cached(model, ids, KVCache(cfg, batch, prompt_len + 1, dtype, device=device))
    t_prefill = time_median(prefill, repeats=3, device=device)
    cache = KVCache(cfg, batch, prompt_len + decode_steps, dtype, device=device)
    forward_cached(model, ids, cache)
    nxt = ids[:, -1:]

    def decode():
        for _ in range(decode_steps):
            forward_cached(model, nxt, cache)
        cache.truncate(cache.lengths - decode_steps)
    t_decode = time_median(decode, repeats=3, device=device) / decode_steps
    prefill_flops = batch * prompt_len * decode_flops_per_token(cfg, prompt_len // 2)
    decode_bytes = decode_bytes_per_step(cfg, elem, prompt_len, batch)
    return {"batch": batch, "prompt_len": prompt_len,
            "prefill_tok_s": batch * prompt_len / t_prefill, "prefill_GFLOPs": prefill_flops / t_prefill / 1e9,
            "decode_tok_s": batch / t_decode, "decode_GBps": decode_bytes / t_decode / 1e9,
            "decode_GFLOPs": batch * decode_flops_per_token(cfg, prompt_len) / t_decode / 1e9}
