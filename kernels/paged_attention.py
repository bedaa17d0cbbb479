"""Paged attention in Triton: store new K/V through the slot mapping, decode over block tables.

Plain-PyTorch twins in minillm/attention/paged.py: store_kv_reference (the store),
paged_attention_split (the decode kernel's tiles and split-K merge) and
paged_attention_reference (the gather-then-softmax definition of right).

Cache layout per layer: k_cache, v_cache (num_blocks, block_size, Hkv, D); see
minillm/attention/paged.py.

store_kv: grid (T,). Program t copies token t's (Hkv, D) row of K and of V to its slot
(slot = block * block_size + offset); slot -1 marks padding and is skipped.

paged_decode: grid (B, Hkv, num_splits). One program owns one sequence, one KV head and one
segment of the context:
- GQA packing: the Hq / Hkv query heads that read this KV head are the rows of one query tile
  (padded to 16 rows, the smallest tl.dot tile), so each K/V tile is loaded once for all of
  them and the scores are a small matrix product instead of Hq / Hkv vector products.
- The page walk: each KV tile is BLOCK_N consecutive positions; position p lives in physical
  block block_table[p // block_size] at row p % block_size. Looking that up per position lets
  one tile span several pages (or pages of 1 token), so the tile size and the page size are
  independent and block sizes 1 and 16 run the same code.
- Online softmax in fp32 (running max m, sum l, accumulator acc), exp2 with the scale folded in.
- Split-K (flash-decoding): with a small batch and a long context, B * Hkv programs cannot fill
  a GPU, so the context is cut into num_splits segments run in parallel. Each writes its
  normalised partial output and its log-sum-exp; _merge_splits combines them with weights
  exp(lse_i - max lse). With num_splits=1 the first kernel writes the output directly.
- seq_len 0 (padding rows of a batch) gives a zero output.
- Under TRITON_INTERPRET=1, tl.dot on bf16 operands is wrong (triton issue #11584), so the
  interpreter path upcasts bf16 tiles to fp32 before each dot (UPCAST). fp32 dots use IEEE
  precision (no TF32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernel_support.args import (INTERPRETED, KERNEL_DTYPES, LOG2E, MAX_HEAD_DIM, check_kernel_device,
                                         check_paged_attention_args)


@triton.jit
def _store_kv(K, V, K_cache, V_cache, Slots,
              stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
              stride_cb, stride_cs, stride_ch, stride_cd,
              HKV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)                                   # (BLOCK_H,)
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    real = (offs_h * 0 + slot) >= 0                                 # (BLOCK_H,) False for padding (slot -1)
    ok = (real & (offs_h < HKV))[:, None] & (offs_d < HEAD_DIM)[None, :]   # (BLOCK_H, BLOCK_D)
    slot = tl.maximum(slot, 0)                                       # padding: masked below anyway
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
        + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd  # (BLOCK_H, BLOCK_D)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd, mask=ok)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd, mask=ok)
    tl.store(K_cache + dst, k.to(K_cache.dtype.element_ty), mask=ok)
    tl.store(V_cache + dst, v.to(V_cache.dtype.element_ty), mask=ok)


@triton.jit
def _paged_decode(Q, K_cache, V_cache, Block_tables, Seq_lens, O, O_part, Lse_part, qk_scale,
                  stride_qb, stride_qh, stride_qd,
                  stride_kb, stride_ks, stride_kh, stride_kd,
                  stride_vb, stride_vs, stride_vh, stride_vd,
                  stride_tb, stride_tn,
                  stride_ob, stride_oh, stride_od,
                  stride_pb, stride_ph, stride_ps, stride_pd,
                  stride_lb, stride_lh, stride_ls,
                  GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kv_h = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(Seq_lens + b)
    seg_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N   # whole tiles per segment
    start = split * seg_len
    end = tl.minimum(start + seg_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)                                   # (BLOCK_G,) query heads of this KV head
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    offs_n = tl.arange(0, BLOCK_N)                                   # (BLOCK_N,)
    heads = kv_h * GROUP + offs_g                                    # (BLOCK_G,)
    d_ok = offs_d < HEAD_DIM
    q_ok = (offs_g < GROUP)[:, None] & d_ok[None, :]                 # (BLOCK_G, BLOCK_D)
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=q_ok, other=0.0)                                # (BLOCK_G, BLOCK_D)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)       # running max (log2 units)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)                      # running sum of exp2
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)             # running unnormalised output
    for t0 in range(start, end, BLOCK_N):
        pos = t0 + offs_n                                            # (BLOCK_N,) token positions
        pos_ok = pos < end
        page = tl.load(Block_tables + b * stride_tb + (pos // BLOCK_SIZE) * stride_tn,
                       mask=pos_ok, other=0).to(tl.int64)            # (BLOCK_N,) the page walk
        row = pos % BLOCK_SIZE                                       # (BLOCK_N,) row in its page
        kt = tl.load(K_cache + page[None, :] * stride_kb + row[None, :] * stride_ks + kv_h * stride_kh
                     + offs_d[:, None] * stride_kd,
                     mask=pos_ok[None, :] & d_ok[:, None], other=0.0)   # (BLOCK_D, BLOCK_N): K^T
        v = tl.load(V_cache + page[:, None] * stride_vb + row[:, None] * stride_vs + kv_h * stride_vh
                    + offs_d[None, :] * stride_vd,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)    # (BLOCK_N, BLOCK_D)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_G, BLOCK_N), log2 units
        s = tl.where(pos_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                        # (BLOCK_G,)
        p = tl.math.exp2(s - m_new[:, None])                         # (BLOCK_G, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_new)                            # (BLOCK_G,) rescales the old state
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)   # (BLOCK_G, BLOCK_D)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]                 # empty segment: zeros, not 0/0
    if NUM_SPLITS == 1:
        tl.store(O + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=q_ok)
    else:
        tl.store(O_part + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps
                 + offs_d[None, :] * stride_pd, out, mask=q_ok)
        lse = tl.where(l_i > 0, m_i + tl.math.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))   # (BLOCK_G,) log2 units
        tl.store(Lse_part + b * stride_lb + heads * stride_lh + split * stride_ls, lse,
                 mask=offs_g < GROUP)


@triton.jit
def _merge_splits(O_part, Lse_part, O,
                  stride_pb, stride_ph, stride_ps, stride_pd,
                  stride_lb, stride_lh, stride_ls,
                  stride_ob, stride_oh, stride_od,
                  NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)                                   # (BLOCK_S,)
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    s_ok = offs_s < NUM_SPLITS
    lse = tl.load(Lse_part + b * stride_lb + h * stride_lh + offs_s * stride_ls,
                  mask=s_ok, other=float("-inf"))                    # (BLOCK_S,)
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)       # seq_len 0: every weight 0
    w = tl.math.exp2(lse - lse_max)                                  # (BLOCK_S,) segment weights
    part = tl.load(O_part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps
                   + offs_d[None, :] * stride_pd,
                   mask=s_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)   # (BLOCK_S, BLOCK_D)
    w_sum = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(w_sum > 0, w_sum, 1.0)  # (BLOCK_D,)
    tl.store(O + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(O.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, slots_checked: bool = False) -> None:
    """Write k, v (T, Hkv, D) into k_cache, v_cache (num_blocks, block_size, Hkv, D) at slot_mapping (T,).
    slots_checked=True skips the slot range check (a device sync): for callers whose slots come from
    the block manager, as the model runner's do."""
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k and v must be (T, Hkv, D) matching the cache's (Hkv, D) "
                         f"{tuple(k_cache.shape[2:])}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if tuple(slot_mapping.shape) != (k.shape[0],):
        raise ValueError(f"slot_mapping must be (T={k.shape[0]},), got {tuple(slot_mapping.shape)}")
    check_kernel_device(k, v, k_cache, v_cache, slot_mapping)
    T, Hkv, D = k.shape
    if T == 0:
        return
    if not slots_checked:                    # the kernel writes wherever a slot points: a bad one corrupts memory
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        lo, hi = (int(x) for x in slot_mapping.aminmax())
        if lo < -1 or hi >= num_slots:
            raise ValueError(f"slot_mapping holds slots {lo}..{hi}; allowed: [-1, {num_slots}) "
                             f"(-1 = padding; the cache has {k_cache.shape[0]} blocks of {k_cache.shape[1]})")
    _store_kv[(T,)](k, v, k_cache, v_cache, slot_mapping,
                    *k.stride(), *v.stride(), *k_cache.stride(),
                    HKV=Hkv, HEAD_DIM=D, BLOCK_H=triton.next_power_of_2(Hkv),
                    BLOCK_D=triton.next_power_of_2(D), BLOCK_SIZE=k_cache.shape[1])


def paged_attention_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           sm_scale: float | None = None, num_splits: int = 1,
                           block_n: int | None = None) -> torch.Tensor:
    """Decode attention over a paged cache. q (B, Hq, D), block_tables (B, max_blocks) int,
    seq_lens (B,) int -> o (B, Hq, D). num_splits > 1 runs the split-K (flash-decoding) variant."""
    check_paged_attention_args(q, k_cache, v_cache, block_tables, seq_lens)
    check_kernel_device(q, k_cache, v_cache, block_tables, seq_lens)
    if not q.dtype == k_cache.dtype == v_cache.dtype:     # tl.dot takes one dtype (an int8 cache is dequantised first)
        raise ValueError(f"dtypes of q, k_cache, v_cache must agree, got {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype {str(q.dtype).removeprefix('torch.')} is not supported; allowed: "
                         f"{', '.join(str(d).removeprefix('torch.') for d in KERNEL_DTYPES)}")
    B, Hq, D = q.shape
    Hkv, block_size = k_cache.shape[2], k_cache.shape[1]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be <= {MAX_HEAD_DIM}, got {D}")
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if block_n is None:
        block_n = 64
    if not isinstance(block_n, int) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n!r}")
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    group = Hq // Hkv
    block_d = max(16, triton.next_power_of_2(D))                     # tl.dot tiles: >= 16, powers of two
    consts = dict(GROUP=group, BLOCK_G=max(16, triton.next_power_of_2(group)), HEAD_DIM=D,
                  BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
                  UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
                  DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    o = torch.empty_like(q)                                                   # (B, Hq, D)
    if num_splits == 1:
        o_part = lse_part = o                                                 # unused by the kernel
        part_strides, lse_strides = (0, 0, 0, 0), (0, 0, 0)
    else:
        o_part = torch.empty(B, Hq, num_splits, D, dtype=torch.float32, device=q.device)   # (B, Hq, S, D)
        lse_part = torch.empty(B, Hq, num_splits, dtype=torch.float32, device=q.device)    # (B, Hq, S)
        part_strides, lse_strides = o_part.stride(), lse_part.stride()
    _paged_decode[(B, Hkv, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, o, o_part, lse_part, sm_scale * LOG2E,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *block_tables.stride(), *o.stride(),
        *part_strides, *lse_strides, **consts)
    if num_splits > 1:
        _merge_splits[(B, Hq)](o_part, lse_part, o, *o_part.stride(), *lse_part.stride(), *o.stride(),
                               NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                               HEAD_DIM=D, BLOCK_D=triton.next_power_of_2(D))
    return o
