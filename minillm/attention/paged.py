"""Paged attention in PyTorch: the K/V tensors of the paged cache, and decode attention over them.

minillm/kvcache/block_manager.py decides, in plain Python, which block and slot each token's K/V goes
to; this file moves the numbers. Layout of one layer's cache: k_cache, v_cache (num_blocks,
block_size, Hkv, D). Why this order (vLLM's flash-attention layout): a token's K for all heads is
one contiguous row of Hkv*D numbers, exactly the (T, Hkv, D) that the K projection produces, so
the store is a row scatter and `cache.view(-1, Hkv, D)[slot]` is the token at `slot`; for one
head, a block is block_size rows of D contiguous numbers, which the decode kernel loads as a tile.

    store_kv_reference         new K/V rows into their slots
    copy_blocks                BlockManager.append_slots' copy-on-write pairs
    gather_kv                  whole blocks of block tables -> K, V padded to whole blocks
    paged_attention_reference  decode attention the simple way: gather, then plain softmax
    decode_attention_fused     the same, written for torch.compile: the CPU engine's decode path
    paged_attention_split      the Triton decode kernel's algorithm: tiles, page walk, split-K

The model runner (minillm/model/runner.py) stores, copies and gathers with these on CPU; on a GPU
the store and the decode attention are the Triton kernels in kernels/paged_attention.py, whose
twins are the store and the two references here.

An int8 KV cache (lesson 04, minillm/quant/kv_int8.py) keeps int8 values plus one fp16 scale per
(token, KV head) in k_scale, v_scale (num_blocks, block_size, Hkv, 1): the store quantises each
token once, when it is written, the gather dequantises, and block copies move the scales with
the values. An fp8 cache (minillm/quant/kv_fp8.py) is the same with e4m3 values held as uint8 bits.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from minillm.kernel_support.args import check_paged_attention_args
from minillm.quant.kv_fp8 import dequantize_kv_fp8, quantize_kv_fp8
from minillm.quant.kv_int8 import dequantize_kv, quantize_kv


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """Zeroed k_cache, v_cache, each (num_blocks, block_size, Hkv, D)."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device))


def block_table_tensor(tables: Sequence[Sequence[int]], device: str | torch.device = "cpu") -> torch.Tensor:
    """Pad block tables to one (B, max_blocks) int32 tensor (the padding is never read)."""
    width = max([1, *map(len, tables)])
    padded = [list(table) + [0] * (width - len(table)) for table in tables]
    return torch.tensor(padded, dtype=torch.int32).reshape(len(tables), width).to(device)


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None, skip_padding: bool = True) -> None:
    """Write k, v (T, Hkv, D) into the caches at slot_mapping (T,): a row scatter.

    Slot -1 marks padding and is skipped (the Triton store's contract); skip_padding=False says
    that every slot is real (the block manager's) and saves the masking. With k_scale, v_scale
    the caches are int8 (or fp8 bits in uint8: quant/kv_fp8.py) and each row is quantised here.
    """
    if skip_padding:
        keep = slot_mapping >= 0                                         # (T,)
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]        # (T', Hkv, D), (T', Hkv, D), (T',)
    slots = slot_mapping.long()
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v)):
        rows = cache.view(-1, *cache.shape[2:])                          # (num_blocks * block_size, Hkv, D)
        if scales is None:
            rows.index_copy_(0, slots, x.to(cache.dtype))
        else:                                                            # int8, or fp8 bits in uint8
            quantize = quantize_kv_fp8 if cache.dtype == torch.uint8 else quantize_kv
            q, scale = quantize(x[None])                                 # (1, T', Hkv, D), (1, T', Hkv, 1)
            rows.index_copy_(0, slots, q[0])
            scales.view(-1, *scales.shape[2:]).index_copy_(0, slots, scale[0])


def copy_blocks(caches: Sequence[torch.Tensor], copies: Sequence[tuple[int, int]], block_dim: int = 0) -> None:
    """Carry out BlockManager.append_slots' copy-on-write pairs (src, dst) on every tensor of
    caches (K, V, and an int8 cache's scales), whose dimension block_dim indexes blocks: 0 for
    one layer's (num_blocks, block_size, Hkv, D), 1 for all layers' at once (L, num_blocks, ...)."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies], device=caches[0].device)
    dst = torch.tensor([d for _, d in copies], device=caches[0].device)
    for cache in caches:
        cache.index_copy_(block_dim, dst, cache.index_select(block_dim, src))


def gather_blocks(cache: torch.Tensor, block_tables: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache (num_blocks, block_size, *row), block_tables (B, n) -> (B, n * block_size, *row).

    Whole blocks are copied (one index_select of block_size contiguous rows each), not single
    slots: the same bytes in block_size times fewer, larger copies (lesson 07). Positions
    past a sequence's length (the rest of its last block, padding blocks) hold stale data and
    must be masked. `out` (B * n, block_size, *row) lets all layers reuse one buffer.
    """
    B, n = block_tables.shape
    blocks = torch.index_select(cache, 0, block_tables.reshape(-1), out=out)   # (B*n, bs, *row)
    return blocks.view(B, n * cache.shape[1], *cache.shape[2:])


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32, out: tuple | None = None):
    """K, V of (B, n) block tables, each (B, n * block_size, Hkv, D), whole blocks at a time
    (gather_blocks: positions past a sequence's length hold stale data, mask them). An int8 cache
    (k_scale, v_scale) comes back dequantised to dtype (an fp8 one too: uint8 bits). out: two buffers for gather_blocks."""
    result = []
    for j, (cache, scales) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
        x = gather_blocks(cache, block_tables, None if out is None else out[j])   # (B, n * bs, Hkv, D)
        if scales is not None:
            dequantize = dequantize_kv_fp8 if cache.dtype == torch.uint8 else dequantize_kv
            x = dequantize(x, gather_blocks(scales, block_tables), dtype)
        result.append(x)
    return result[0], result[1]


def decode_attention_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, window: int | None = None,
                           runs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Decode attention over a paged cache, written for torch.compile on CPU (the engine compiles it).

    q (B, Hq, D): one new token per sequence; k_cache, v_cache (num_blocks, block_size, Hkv, D);
    block_tables (B, n) int64; seq_lens (B,) keys per sequence (>= 1). -> (B, Hq, D) in q's dtype,
    computed in fp32 with the 1/sqrt(D) scale. The gather, the upcast, q.K, the masked softmax and
    p.V are written as indexing, broadcast products and sums, so that Inductor fuses them into loops
    that read each sequence's blocks from the cache once: no gathered copy of K/V, no fp32 copy
    (what the gather-then-SDPA path pays every layer). The query heads of one KV head are its G
    rows (GQA without repeating K/V). window: each row sees only its last `window` keys (Mistral; the
    blocks before them may have been freed: their table entries are masked). runs: (starts, masks), (B,)
    int64 each: a row sees every key before its run's first one (starts) and, of the run's own keys
    start + j (j < 63), those whose bit j is set in its mask; causal rows have bits 0..t, a tree draft's
    row its ancestors' and its own (NEW: tree drafts); seq_lens then only places the window. Run eagerly it would
    materialise a (B, Hkv, G, L, D) product:
    compiled use only (the runner falls back to gather + SDPA where compiling fails).
    """
    B, Hq, D = q.shape
    block_size, Hkv, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]     # Dv < D: a latent (MLA) cache
    G, L = Hq // Hkv, block_tables.shape[1] * block_size
    keys = k_cache[block_tables].view(B, L, Hkv, D).permute(0, 2, 1, 3).float()       # (B, Hkv, L, D)
    values = v_cache[block_tables].reshape(B, L, Hkv, Dv).permute(0, 2, 1, 3).float()  # (B, Hkv, L, Dv)
    qg = q.view(B, Hkv, G, D).float() * D ** -0.5                                         # (B, Hkv, G, D)
    scores = (qg[:, :, :, None, :] * keys[:, :, None]).sum(-1)                          # (B, Hkv, G, L)
    key_pos = torch.arange(L, device=q.device)
    if runs is None:
        past = key_pos >= seq_lens[:, None, None, None]                                  # (B, 1, 1, L)
    else:                                                    # NEW: tree drafts: the run's keys by bit
        starts, masks = runs
        rel = key_pos - starts[:, None]                                                  # (B, L)
        bit = (masks[:, None] >> rel.clamp(0, 62)) & 1
        past = ((rel >= 0) & ((rel > 62) | (bit == 0)))[:, None, None, :]                # (B, 1, 1, L)
    if window is not None:                                   # a sliding window: only the last `window` keys
        past = past | (key_pos < seq_lens[:, None, None, None] - window)
    weights = torch.softmax(scores.masked_fill(past, float("-inf")), dim=-1)            # (B, Hkv, G, L)
    values = values.masked_fill(past.transpose(-1, -2), 0.0)                             # stale inf/nan * 0 would be nan
    out = (weights[..., None] * values[:, :, None]).sum(-2)                              # (B, Hkv, G, Dv)
    return out.reshape(B, Hq, Dv).to(q.dtype)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              block_tables: torch.Tensor, seq_lens: torch.Tensor,
                              sm_scale: float) -> torch.Tensor:
    """Decode attention over a paged cache, the simple way: gather, then plain softmax.

    q (B, Hq, D): one new token per sequence; block_tables (B, max_blocks); seq_lens (B,)
    tokens in the cache for each sequence (0 gives a zero output). Query head h reads KV
    head h // (Hq // Hkv). Computed in fp32, returned as (B, Hq, D) in q's dtype.
    """
    check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens)
    group = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)                                        # (B, Hq, D)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        table = block_tables[b:b + 1, :math.ceil(seq_len / k_cache.shape[1])]   # (1, nb)
        k, v = (x[0, :seq_len] for x in gather_kv(k_cache, v_cache, table))     # (L, Hkv, D) each
        k = k.float().repeat_interleave(group, dim=1)                    # (L, Hq, D)
        v = v.float().repeat_interleave(group, dim=1)                    # (L, Hq, D)
        scores = torch.einsum("hd,lhd->hl", q[b].float(), k) * sm_scale  # (Hq, L)
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(q.dtype)
    return out


def paged_attention_split(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float,
                          num_splits: int = 1, tile: int = 16) -> torch.Tensor:
    """The Triton decode kernel's algorithm in PyTorch (its twin: same tiles, same merge).

    For each sequence and KV head, the query heads that share the KV head form one
    (group, D) tile. The sequence is cut into num_splits segments (flash-decoding: more
    parallel work when the batch is small and the context long); each segment walks its
    positions `tile` at a time, looks each position's block up in the block table (no
    gather of the whole sequence), and keeps an online softmax (running max m, sum l,
    accumulator acc). Segments are merged through their log-sum-exp.
    """
    check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    B, Hq, D = q.shape
    block_size, Hkv = k_cache.shape[1], k_cache.shape[2]
    group = Hq // Hkv
    out = torch.zeros_like(q)                                            # (B, Hq, D)
    for b, seq_len in enumerate(seq_lens.tolist()):
        qg = q[b].float().view(Hkv, group, D) * sm_scale                 # (Hkv, G, D)
        seg_len = math.ceil(math.ceil(seq_len / num_splits) / tile) * tile
        partials, lses = [], []
        for start in range(0, seq_len, max(seg_len, 1)):
            m = torch.full((Hkv, group), -math.inf, device=q.device)     # running max
            l = torch.zeros(Hkv, group, device=q.device)                 # running sum of exp
            acc = torch.zeros(Hkv, group, D, device=q.device)            # running sum of p @ v
            for t0 in range(start, min(start + seg_len, seq_len), tile):
                pos = torch.arange(t0, min(t0 + tile, seq_len, start + seg_len), device=block_tables.device)  # (N,)
                blocks = block_tables[b, pos // block_size].long()      # (N,) the page walk
                k = k_cache[blocks, pos % block_size].float()            # (N, Hkv, D)
                v = v_cache[blocks, pos % block_size].float()            # (N, Hkv, D)
                s = torch.einsum("hgd,nhd->hgn", qg, k)                  # (Hkv, G, N)
                m_new = torch.maximum(m, s.amax(-1))                     # (Hkv, G)
                p = torch.exp(s - m_new[..., None])                      # (Hkv, G, N)
                alpha = torch.exp(m - m_new)                             # rescales the old state
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + torch.einsum("hgn,nhd->hgd", p, v)
                m = m_new
            partials.append(acc / l[..., None])                          # (Hkv, G, D) normalised
            lses.append(m + torch.log(l))                                # (Hkv, G)
        if not partials:
            continue                                                     # seq_len 0: zeros
        lse = torch.stack(lses)                                          # (S, Hkv, G)
        weights = torch.exp(lse - lse.amax(0))                           # exp(lse_i - lse_max)
        merged = (weights[..., None] * torch.stack(partials)).sum(0) / weights.sum(0)[..., None]
        out[b] = merged.view(Hq, D).to(q.dtype)
    return out
