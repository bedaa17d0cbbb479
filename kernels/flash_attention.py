"""FlashAttention forward in Triton. Plain-PyTorch twin: minillm/attention/flash.py:flash_attention_torch.

Grid: (cdiv(Tq, BLOCK_M), B * Hq). One program owns BLOCK_M query rows of one query head,
keeps them in SRAM/registers, streams the K and V tiles of its KV head past them and never
writes a score to memory. Its state is fp32: m (running max), l (running sum), acc (BLOCK_M, D).

Details worth knowing:
- exp2 instead of exp: scores are pre-multiplied by sm_scale * log2(e), so exp2(x) = exp(x / log2 e)
  and the hardware's fast exp2 does the work. The LSE is converted back to natural log on store.
- Two loops over key tiles: first the tiles every row may fully see (no mask at all), then the
  tiles that cross the causal diagonal or the end of the keys (masked). Causal tiles wholly above
  the diagonal are never visited: that is where the causal 2x saving comes from.
- GQA: program (.., h) reads KV head h // GROUP straight from k and v; nothing is copied.
- Any Tq, Tk (rows and columns masked at the edges), any head dim up to 256 (padded to a power
  of two, the padding masked), fp32 / fp16 / bf16. fp32 dots use IEEE precision (no TF32).
- Under TRITON_INTERPRET=1 tl.dot on bf16 operands is wrong (triton issue #11584), so the
  interpreter path upcasts bf16 tiles to fp32 before each dot (UPCAST constexpr). On a GPU the
  dots run natively in bf16/fp16 with fp32 accumulation.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernel_support.args import (INTERPRETED, LOG2E, MAX_HEAD_DIM, check_attention_inputs, check_kernel_device,
                                         override_tiles)
from minillm.kernel_support.tuning import choose_config, length_bucket


@triton.jit
def _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                    offs_m, offs_d, lo, hi, Tk, pos_offset, qk_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                    MASK: tl.constexpr, MASK_LOADS: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi). MASK=False: the tiles are known to be fully visible.
    MASK_LOADS: bound-check the K/V loads (always when MASK, or when the head dim is padded)."""
    offs_n = tl.arange(0, BLOCK_N)
    d_ok = offs_d < HEAD_DIM                                         # (BLOCK_D,) false only on head-dim padding
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n                                      # (BLOCK_N,) key positions
        kt_ptrs = k_base + cols[None, :] * stride_kn + offs_d[:, None] * stride_kd   # (BLOCK_D, BLOCK_N): K^T
        v_ptrs = v_base + cols[:, None] * stride_vn + offs_d[None, :] * stride_vd    # (BLOCK_N, BLOCK_D)
        if MASK_LOADS:
            kt_ok = (cols < Tk)[None, :] & d_ok[:, None]             # (BLOCK_D, BLOCK_N)
            kt = tl.load(kt_ptrs, mask=kt_ok, other=0.0)
            v = tl.load(v_ptrs, mask=(cols < Tk)[:, None] & d_ok[None, :], other=0.0)
        else:                                                        # the common case: no mask, vector loads
            kt = tl.load(kt_ptrs)
            v = tl.load(v_ptrs)
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        # BEGIN SOLUTION flash_triton
        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N), log2 units
        if MASK:
            keep = (cols < Tk)[None, :]
            if CAUSAL:
                keep = keep & (cols[None, :] <= (pos_offset + offs_m)[:, None])
            s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))                        # (BLOCK_M,)
        p = tl.math.exp2(s - m_new[:, None])                         # (BLOCK_M, BLOCK_N)
        alpha = tl.math.exp2(m_i - m_new)                            # (BLOCK_M,) rescales the old state
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)   # (BLOCK_M, BLOCK_D)
        m_i = m_new
        # END SOLUTION
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q, K, V, O, LSE,
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              Hq, Tq, Tk, qk_scale,
              GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAD_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)                                      # int64: large tensors overflow int32 offsets
    h = (bh % Hq).to(tl.int64)
    kv_h = h // GROUP                                                # GQA: the KV head this query head reads
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + kv_h * stride_kh
    v_base = V + b * stride_vb + kv_h * stride_vh
    o_base = O + b * stride_ob + h * stride_oh

    offs_m = start_m + tl.arange(0, BLOCK_M)                         # (BLOCK_M,) query rows
    offs_d = tl.arange(0, BLOCK_D)                                   # (BLOCK_D,)
    q_ok = (offs_m < Tq)[:, None] & (offs_d < HEAD_DIM)[None, :]     # (BLOCK_M, BLOCK_D)
    q = tl.load(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                mask=q_ok, other=0.0)                                # (BLOCK_M, BLOCK_D), stays on chip
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)       # running max (log2 units)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)                      # running sum of exp2
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)             # running unnormalised output

    pos_offset = Tk - Tq                                             # absolute position of query 0
    if CAUSAL:
        hi = tl.minimum(Tk, pos_offset + start_m + BLOCK_M)          # later keys: invisible to every row here
        full_end = tl.minimum(Tk, pos_offset + start_m + 1) // BLOCK_N * BLOCK_N   # visible to the first row
    else:
        hi = Tk
        full_end = Tk // BLOCK_N * BLOCK_N
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, 0, full_end, Tk, pos_offset, qk_scale,
                                    HEAD_DIM, BLOCK_N, CAUSAL, False, PAD_D, UPCAST, DOT_PRECISION)
    acc, l_i, m_i = _attn_fwd_tiles(acc, l_i, m_i, q, k_base, v_base, stride_kn, stride_kd, stride_vn, stride_vd,
                                    offs_m, offs_d, full_end, hi, Tk, pos_offset, qk_scale,
                                    HEAD_DIM, BLOCK_N, CAUSAL, True, True, UPCAST, DOT_PRECISION)

    # BEGIN SOLUTION flash_triton
    o = acc / l_i[:, None]                                           # (BLOCK_M, BLOCK_D)
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
             o.to(O.dtype.element_ty), mask=q_ok)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453             # times ln(2): back to natural-log units
    tl.store(LSE + bh.to(tl.int64) * Tq + offs_m, lse, mask=offs_m < Tq)
    # END SOLUTION


# (block_m, block_n, num_warps, num_stages): the first that fits shared memory is the default; on CUDA
# the first TUNED that fit are timed once per shape bucket (minillm/kernel_support/tuning.py), the fastest kept
GPU_CONFIGS = [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 128, 4, 3), (64, 32, 4, 2),
               (32, 32, 4, 1), (16, 16, 2, 1)]
SHARED_MEMORY_BUDGET = 160 * 1024          # bytes; below the 228 KiB an H100/H200 SM has, with room to spare
TUNED = 4                                  # configurations timed per shape: each is a compile, seconds on a GPU


def fitting_configs(device: torch.device, block_d: int, elem_bytes: int) -> list[dict]:
    """Tile sizes and launch options to choose from, the default first. The interpreter prefers few,
    large programs. On a GPU the Q tile plus num_stages buffered K and V tiles must fit shared memory;
    8 warps only for wide heads."""
    if device.type != "cuda":
        return [dict(block_m=32, block_n=32, num_warps=4, num_stages=1)]
    fits = [dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
            for block_m, block_n, num_warps, num_stages in GPU_CONFIGS
            if not (num_warps == 8 and block_d < 128)                       # 4 warps suffice for D <= 64
            and (block_m * block_d + num_stages * 2 * block_n * block_d) * elem_bytes <= SHARED_MEMORY_BUDGET]
    if not fits:
        raise ValueError(f"no tile configuration fits head dim {block_d}")
    return fits[:TUNED]


def triton_flash_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                                   sm_scale: float | None = None, block_m: int | None = None,
                                   block_n: int | None = None):
    """Launch the kernel. q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D). Returns (o like q, lse (B, Hq, Tq) fp32).
    block_m / block_n given: those tiles; else the configuration kernel_support.tuning chose for this shape."""
    scale = check_attention_inputs(q, k, v, causal, sm_scale)
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    if D > MAX_HEAD_DIM:
        raise ValueError(f"head dim D must be <= {MAX_HEAD_DIM} for the Triton kernel, got {D}")
    check_kernel_device(q, k, v)
    block_d = max(16, triton.next_power_of_2(D))                            # tl.dot wants >= 16, powers of two
    configs = fitting_configs(q.device, block_d, q.element_size())

    def run(config):
        o = torch.empty(B, Hq, Tq, D, dtype=q.dtype, device=q.device)      # (B, Hq, Tq, D)
        lse = torch.empty(B, Hq, Tq, dtype=torch.float32, device=q.device) # (B, Hq, Tq)
        grid = (triton.cdiv(Tq, config["block_m"]), B * Hq)
        _attn_fwd[grid](
            q, k, v, o, lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            Hq, Tq, Tk, scale * LOG2E,
            GROUP=Hq // Hkv, HEAD_DIM=D, BLOCK_D=block_d, PAD_D=block_d != D,
            BLOCK_M=config["block_m"], BLOCK_N=config["block_n"], CAUSAL=bool(causal),
            UPCAST=INTERPRETED and q.dtype == torch.bfloat16,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=config["num_warps"], num_stages=config["num_stages"],
        )
        return o, lse

    if block_m is not None or block_n is not None:
        return run(override_tiles(dict(configs[0]), block_m=block_m, block_n=block_n))
    key = ("flash-forward", Hq // Hkv, D, str(q.dtype), bool(causal), length_bucket(B * Hq), length_bucket(Tq),
           length_bucket(Tk), str(q.device))
    return run(choose_config(key, configs, run))
