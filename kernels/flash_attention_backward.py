"""FlashAttention backward in Triton (FlashAttention-2's split). Plain-PyTorch twin:
minillm/attention/flash.py:flash_attention_backward_torch. Forward: kernels/flash_attention.py.

The forward kept only O and the (B, Hq, Tq) log-sum-exp; every probability is rebuilt here,
tile by tile, as P = exp(S - LSE) with S = Q K^T * sm_scale. With D_i = rowsum(dO_i * O_i):
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = dS K * scale,   dK = dS^T Q * scale.

Three kernels:
- _attn_bwd_preprocess, grid (cdiv(Tq, BLOCK_M), B * Hq): delta = rowsum(dO * O), (B, Hq, Tq) fp32.
  One small pass, so the two main kernels read D_i instead of both recomputing it.
- _attn_bwd_dkdv, grid (cdiv(Tk, BLOCK_N), B * Hkv): one program owns one K/V tile and its dK, dV
  accumulators, and streams every query tile that can see it past them, for each of the GROUP query
  heads that share this KV head (GQA). All contributions to a dK/dV row therefore land in one
  program: they are written once, with no atomics and no (B, Hq, Tk, D) buffer to reduce afterwards.
- _attn_bwd_dq, grid (cdiv(Tq, BLOCK_M), B * Hq): one program owns one Q tile and its dQ, streams the
  key tiles it can see. dQ could also be added from the dK/dV kernel with atomics (one pass over
  S instead of two); a separate kernel recomputes P once more but stays deterministic and atomic-free.

Same conventions as the forward: exp2 with scores pre-multiplied by sm_scale * log2(e) (the saved
LSE, natural log, is converted on load); causal with pos_offset = Tk - Tq (queries are the last Tq
positions); tiles wholly above the diagonal are skipped; edges and head-dim padding masked; fp32
accumulation and IEEE fp32 dots; bf16 tiles upcast under the interpreter (triton #11584).
Unlike the forward, every tile here is masked (no separate unmasked loop): simpler, and this
kernel's GPU speed has not been measured yet. Its tiles are chosen per shape by timing on CUDA
(fitting_configs, minillm/kernel_support/tuning.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernel_support.args import (INTERPRETED, LOG2E, MAX_HEAD_DIM, check_attention_inputs, check_kernel_device,
                                         override_tiles)
from minillm.kernel_support.tuning import choose_config, length_bucket


@triton.jit
def _attn_bwd_preprocess(O, DO, DELTA,
                         stride_ob, stride_oh, stride_om, stride_od,
                         stride_dob, stride_doh, stride_dom, stride_dod,
                         Hq, Tq,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)                                      # int64: large tensors overflow int32 offsets
    h = (bh % Hq).to(tl.int64)
    offs_m = start_m + tl.arange(0, BLOCK_M)                         # (BLOCK_M,) query rows
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    ok = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]       # (BLOCK_M, BLOCK_D)
    o = tl.load(O + b * stride_ob + h * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                mask=ok, other=0.0).to(tl.float32)                   # (BLOCK_M, BLOCK_D)
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=ok, other=0.0).to(tl.float32)                  # (BLOCK_M, BLOCK_D)
    delta = tl.sum(o * do, 1)                                        # (BLOCK_M,) D_i = rowsum(dO_i * O_i)
    tl.store(DELTA + bh.to(tl.int64) * Tq + offs_m, delta, mask=offs_m < Tq)


@triton.jit
def _recompute_p(q, k, lse, offs_m, offs_n, m_ok, Tk, pos_offset, qk_scale,
                 CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The forward's probabilities of one (query tile, key tile) from the saved LSE (log2 units):
    P = exp2(q k^T * scale * log2 e - lse), 0 where the row or key is padding or, if CAUSAL, in the future."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale     # (BLOCK_M, BLOCK_N), log2 units
    keep = m_ok[:, None] & (offs_n < Tk)[None, :]
    if CAUSAL:
        keep = keep & (offs_n[None, :] <= (pos_offset + offs_m)[:, None])
    return tl.where(keep, tl.math.exp2(s - lse[:, None]), 0.0)                # (BLOCK_M, BLOCK_N)


@triton.jit
def _attn_bwd_dkdv(Q, K, V, DO, LSE, DELTA, DK, DV,
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   Hkv, Tq, Tk, sm_scale, qk_scale,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                   UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1)
    b = (bkv // Hkv).to(tl.int64)
    kv_h = (bkv % Hkv).to(tl.int64)
    Hq = Hkv * GROUP

    offs_n = start_n + tl.arange(0, BLOCK_N)                         # (BLOCK_N,) key positions
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    d_ok = offs_d < HEAD_DIM                                         # (BLOCK_D,) false only on head-dim padding
    kv_ok = (offs_n < Tk)[:, None] & d_ok[None, :]                   # (BLOCK_N, BLOCK_D)
    k = tl.load(K + b * stride_kb + kv_h * stride_kh + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=kv_ok, other=0.0)                               # (BLOCK_N, BLOCK_D), stays on chip
    v = tl.load(V + b * stride_vb + kv_h * stride_vh + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                mask=kv_ok, other=0.0)                               # (BLOCK_N, BLOCK_D), stays on chip
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)              # sum over query heads and rows
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    pos_offset = Tk - Tq                                             # absolute position of query 0
    if CAUSAL:
        # query row i sees key j iff j <= pos_offset + i: rows before start_n - pos_offset see none of this tile
        lo = tl.maximum(start_n - pos_offset, 0) // BLOCK_M * BLOCK_M
    else:
        lo = 0
    offs_m0 = tl.arange(0, BLOCK_M)
    for g in range(GROUP):                                           # GQA: every query head reading this KV head
        h = kv_h * GROUP + g
        bh = b * Hq + h                                              # row of the (B * Hq, Tq) LSE and delta
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        for start_m in range(lo, Tq, BLOCK_M):
            offs_m = start_m + offs_m0                               # (BLOCK_M,) query rows
            m_ok = offs_m < Tq
            q_ok = m_ok[:, None] & d_ok[None, :]                     # (BLOCK_M, BLOCK_D)
            q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                        mask=q_ok, other=0.0)                        # (BLOCK_M, BLOCK_D)
            do = tl.load(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                         mask=q_ok, other=0.0)                       # (BLOCK_M, BLOCK_D)
            if UPCAST:
                q = q.to(tl.float32)
                do = do.to(tl.float32)
            lse = tl.load(LSE + bh * Tq + offs_m, mask=m_ok, other=0.0) * 1.4426950408889634   # (BLOCK_M,) log2 units
            delta = tl.load(DELTA + bh * Tq + offs_m, mask=m_ok, other=0.0)                     # (BLOCK_M,)

            p = _recompute_p(q, k, lse, offs_m, offs_n, m_ok, Tk, pos_offset, qk_scale, CAUSAL, DOT_PRECISION)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv, input_precision=DOT_PRECISION)  # (BLOCK_N, BLOCK_D)
            dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)               # (BLOCK_M, BLOCK_N)
            ds = p * (dp - delta[:, None])                           # (BLOCK_M, BLOCK_N) softmax backward; 0 off-mask
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk, input_precision=DOT_PRECISION)   # (BLOCK_N, BLOCK_D)

    dk = dk * sm_scale                                               # S = scale * QK^T: the scale once, at the end
    tl.store(DK + b * stride_dkb + kv_h * stride_dkh + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             dk.to(DK.dtype.element_ty), mask=kv_ok)
    tl.store(DV + b * stride_dvb + kv_h * stride_dvh + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             dv.to(DV.dtype.element_ty), mask=kv_ok)


@triton.jit
def _attn_bwd_dq(Q, K, V, DO, LSE, DELTA, DQ,
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 Hq, Tq, Tk, sm_scale, qk_scale,
                 GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    kv_h = h // GROUP                                                # GQA: the KV head this query head reads
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh

    offs_m = start_m + tl.arange(0, BLOCK_M)                         # (BLOCK_M,) query rows
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    m_ok = offs_m < Tq
    d_ok = offs_d < HEAD_DIM
    q_ok = m_ok[:, None] & d_ok[None, :]                             # (BLOCK_M, BLOCK_D)
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=q_ok, other=0.0)                                # (BLOCK_M, BLOCK_D), stays on chip
    do = tl.load(DO + b * stride_dob + h * stride_doh + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                 mask=q_ok, other=0.0)                               # (BLOCK_M, BLOCK_D), stays on chip
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row = bh.to(tl.int64) * Tq + offs_m
    lse = tl.load(LSE + row, mask=m_ok, other=0.0) * 1.4426950408889634       # (BLOCK_M,) log2 units
    delta = tl.load(DELTA + row, mask=m_ok, other=0.0)                        # (BLOCK_M,)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    pos_offset = Tk - Tq
    if CAUSAL:
        hi = tl.minimum(Tk, pos_offset + start_m + BLOCK_M)          # later keys: invisible to every row here
    else:
        hi = Tk
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + offs_n0                                   # (BLOCK_N,) key positions
        kv_ok = (offs_n < Tk)[:, None] & d_ok[None, :]               # (BLOCK_N, BLOCK_D)
        k = tl.load(k_base + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd, mask=kv_ok, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd, mask=kv_ok, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        p = _recompute_p(q, k, lse, offs_m, offs_n, m_ok, Tk, pos_offset, qk_scale, CAUSAL, DOT_PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BLOCK_M, BLOCK_N)
        ds = p * (dp - delta[:, None])                               # (BLOCK_M, BLOCK_N)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)        # (BLOCK_M, BLOCK_D)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd,
             dq.to(DQ.dtype.element_ty), mask=q_ok)


# (block_m, block_n, num_warps, num_stages): the first that fits shared memory is the default; on CUDA
# the first TUNED that fit are timed once per shape bucket (minillm/kernel_support/tuning.py), the fastest kept
GPU_CONFIGS = [(64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), (64, 64, 8, 3), (32, 32, 4, 1),
               (16, 16, 2, 1)]
SHARED_MEMORY_BUDGET = 160 * 1024          # bytes; as the forward
TUNED = 4                                  # as the forward


def fitting_configs(device: torch.device, block_d: int, elem_bytes: int) -> list[dict]:
    """Tile sizes to choose from, the default first. The dK/dV program keeps K, V (input dtype) and dK, dV
    (fp32) tiles and buffers num_stages Q and dO tiles; that is what must fit. Wide heads take 8 warps.
    The interpreter prefers few, large programs."""
    if device.type != "cuda":
        return [dict(block_m=32, block_n=32, num_warps=4, num_stages=1)]
    fits = []
    for block_m, block_n, num_warps, num_stages in GPU_CONFIGS:
        shared = (2 * block_n * block_d * (elem_bytes + 4) + num_stages * 2 * block_m * block_d * elem_bytes)
        config = dict(block_m=block_m, block_n=block_n, num_warps=8 if block_d >= 128 else num_warps,
                      num_stages=num_stages)
        if shared <= SHARED_MEMORY_BUDGET and config not in fits:
            fits.append(config)
    if not fits:
        raise ValueError(f"no tile configuration fits head dim {block_d}")
    return fits[:TUNED]


def triton_flash_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                                    lse: torch.Tensor, do: torch.Tensor, causal: bool = True,
                                    sm_scale: float | None = None, block_m: int | None = None,
                                    block_n: int | None = None):
    """Gradients of the forward. q/o/do (B, Hq, Tq, D), k/v (B, Hkv, Tk, D), lse (B, Hq, Tq) fp32 in
    natural-log units (what triton_flash_attention_forward returns). Returns (dq, dk, dv) like q, k, v."""
    scale = check_attention_inputs(q, k, v, causal, sm_scale)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(q.shape):
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must have q's shape {tuple(q.shape)}, got {shape}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype must be q's dtype {q.dtype}, got {t.dtype}")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != (B, Hq, Tq) or lse.dtype != torch.float32:
        got = (tuple(lse.shape), lse.dtype) if isinstance(lse, torch.Tensor) else type(lse).__name__
        raise ValueError(f"lse must be a float32 tensor of shape (B, Hq, Tq) = {(B, Hq, Tq)}, got {got}")
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be <= {MAX_HEAD_DIM} for the Triton kernel, got {D}")
    check_kernel_device(q, k, v, o, lse, do)
    block_d = max(16, triton.next_power_of_2(D))                            # tl.dot wants >= 16, powers of two
    configs = fitting_configs(q.device, block_d, q.element_size())
    lse = lse.contiguous()                                                 # indexed as (B * Hq, Tq) rows

    def run(config):
        bm, bn = config["block_m"], config["block_n"]
        launch = dict(num_warps=config["num_warps"], num_stages=config["num_stages"])
        common = dict(GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=bm, BLOCK_N=bn, CAUSAL=bool(causal),
                      UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
                      DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
        delta = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device)  # (B, Hq, Tq)
        _attn_bwd_preprocess[(triton.cdiv(Tq, bm), B * Hq)](
            o, do, delta, *o.stride(), *do.stride(), Hq, Tq,
            HEAD_DIM=D, BLOCK_D=block_d, BLOCK_M=bm, **launch)
        dq = torch.empty_like(q, memory_format=torch.contiguous_format)        # (B, Hq, Tq, D)
        dk = torch.empty_like(k, memory_format=torch.contiguous_format)        # (B, Hkv, Tk, D)
        dv = torch.empty_like(v, memory_format=torch.contiguous_format)        # (B, Hkv, Tk, D)
        _attn_bwd_dkdv[(triton.cdiv(Tk, bn), B * Hkv)](
            q, k, v, do, lse, delta, dk, dv,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            Hkv, Tq, Tk, scale, scale * LOG2E, **common, **launch)
        _attn_bwd_dq[(triton.cdiv(Tq, bm), B * Hq)](
            q, k, v, do, lse, delta, dq,
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(),
            Hq, Tq, Tk, scale, scale * LOG2E, **common, **launch)
        return dq, dk, dv

    if block_m is not None or block_n is not None:
        return run(override_tiles(dict(configs[0]), block_m=block_m, block_n=block_n))
    key = ("flash-backward", Hq // Hkv, D, str(q.dtype), bool(causal), length_bucket(B * Hq), length_bucket(Tq),
           length_bucket(Tk), str(q.device))
    return run(choose_config(key, configs, run))
