"""W4A16: fused 4-bit dequantise + matmul in Triton. Plain-PyTorch twin (same tiling):
minillm/quant/w4a16.py:w4a16_matmul_torch.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), SPLIT_K). A program owns a (BLOCK_M, BLOCK_N) tile of y and
walks its split's share of K in tiles of BLOCK_K columns, each inside one quantisation group (with
SPLIT_K > 1 the splits write fp32 partial sums that _sum_splits_kernel below adds in order: more
programs when N / BLOCK_N alone would leave SMs idle). Per K tile it loads
    the packed bytes (BLOCK_N, BLOCK_K/2) uint8: high nibble = even column, low = odd column,
    the group's scale (BLOCK_N,) (and zero point, or it looks codes up in the 16-entry NF4 table),
    x's even and odd columns (BLOCK_M, BLOCK_K/2) each,
dequantises in registers and accumulates two dots in fp32. Weights cross the memory bus as 4-bit
codes only. MODE: 0 int4 symmetric (z = 8), 1 int4 with zero points, 2 NF4.

Interpreter note: tl.dot on bf16 operands is wrong under TRITON_INTERPRET=1 (triton #11584), so
the interpreted path upcasts to fp32 before the dots (UPCAST); on a GPU the dots run in x's dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from minillm.kernel_support.args import INTERPRETED, W4A16_MODES, check_kernel_device, override_tiles, w4a16_tile_k


@triton.jit
def _w4a16_kernel(X, P, S, Z, CODE, Y, M, N, K, n_tiles, tiles_per_split,
                  stride_xm, stride_xk, stride_pn, stride_pk, stride_sn, stride_sg, stride_ys, stride_ym, stride_yn,
                  GROUP: tl.constexpr, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # (BM,) rows of x and y
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # (BN,) rows of W, columns of y
    offs_b = tl.arange(0, BLOCK_K // 2)                              # (BK/2,) byte = column pair in the tile
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * tiles_per_split
    for t in range(first, tl.minimum(first + tiles_per_split, n_tiles)):
        k0 = t * BLOCK_K
        pair = k0 // 2 + offs_b                                      # (BK/2,) byte index in the row
        k_ok = pair < K // 2
        byte = tl.load(P + offs_n[:, None] * stride_pn + pair[None, :] * stride_pk,
                       mask=n_ok[:, None] & k_ok[None, :], other=0)  # (BN, BK/2) uint8
        hi = (byte >> 4).to(tl.int32)                                # even columns
        lo = (byte & 0xF).to(tl.int32)                               # odd columns
        g = k0 // GROUP                                              # the tile's group
        s = tl.load(S + offs_n * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)  # (BN,)
        if MODE == 2:                                                # NF4: look the codes up
            w_even = tl.load(CODE + hi) * s[:, None]
            w_odd = tl.load(CODE + lo) * s[:, None]
        else:
            if MODE == 1:
                z = tl.load(Z + offs_n * stride_sn + g * stride_sg, mask=n_ok, other=0).to(tl.float32)  # (BN,)
            else:
                z = tl.full((BLOCK_N,), 8.0, tl.float32)
            w_even = (hi.to(tl.float32) - z[:, None]) * s[:, None]   # (BN, BK/2)
            w_odd = (lo.to(tl.float32) - z[:, None]) * s[:, None]
        x_ptrs = X + offs_m[:, None] * stride_xm + (2 * pair)[None, :] * stride_xk
        x_ok = m_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_ptrs, mask=x_ok, other=0.0)               # (BM, BK/2)
        x_odd = tl.load(x_ptrs + stride_xk, mask=x_ok, other=0.0)
        if UPCAST:
            x_even = x_even.to(tl.float32)
            x_odd = x_odd.to(tl.float32)
        else:                                                        # the weights take x's dtype (W4A16)
            w_even = w_even.to(x_even.dtype)
            w_odd = w_odd.to(x_even.dtype)
        acc = tl.dot(x_even, tl.trans(w_even), acc, input_precision=DOT_PRECISION)
        acc = tl.dot(x_odd, tl.trans(w_odd), acc, input_precision=DOT_PRECISION)
    y_ptrs = Y + pid_s * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_splits_kernel(PART, Y, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """Y (size,) = the sum over s of PART[s] (SPLIT_K, size) fp32, in order (deterministic), in Y's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(PART + s * size + offs, mask=ok, other=0.0)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


def split_k_plan(n_tiles: int, split_k: int) -> tuple[int, int]:
    """(splits, tiles per split) for n_tiles K tiles asked to be cut in split_k parts, none of them empty."""
    if isinstance(split_k, bool) or not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"split_k must be a positive integer, got {split_k!r}")
    per_split = triton.cdiv(n_tiles, min(split_k, n_tiles))
    return triton.cdiv(n_tiles, per_split), per_split


def split_output(y: torch.Tensor, splits: int) -> torch.Tensor:
    """Where the kernel writes: y itself, or fp32 partial sums (splits, M, N) that sum_splits adds into y."""
    return y if splits == 1 else torch.empty(splits, *y.shape, dtype=torch.float32, device=y.device)


def sum_splits(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out is not y:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(y.numel(), block),)](out, y, y.numel(), SPLIT_K=out.shape[0], BLOCK=block)
    return y


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                 code: torch.Tensor | None = None, *, group: int, block_m: int | None = None,
                 block_n: int | None = None, split_k: int = 1, num_warps: int = 4, num_stages: int = 2) -> torch.Tensor:
    """x (M, K) fp32/fp16/bf16, packed uint8 (N, K/2), scale (N, ceil(K/group)), zero (like scale) or None,
    code (16,) float32 for NF4 -> y (M, N) in x.dtype. block_m / block_n: powers of two >= 16."""
    check_kernel_device(*(t for t in (x, packed, scale, zero, code) if t is not None))
    M, K = x.shape
    N = packed.shape[0]
    if packed.shape[1] * 2 != K or K % 2:
        raise ValueError(f"packed has {packed.shape[1]} bytes per row, x has K = {K} columns: need K = 2 * bytes")
    block_k = w4a16_tile_k(group)
    mode = W4A16_MODES["nf4" if code is not None else "int-zero" if zero is not None else "int-sym"]
    tiles = override_tiles({"block_m": 16 if M <= 16 else 64, "block_n": 32 if INTERPRETED else 64},
                           block_m=block_m, block_n=block_n)
    n_tiles = triton.cdiv(K, block_k)
    splits, per_split = split_k_plan(n_tiles, split_k)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = split_output(y, splits)
    dummy = scale                                                    # unused pointer for absent operands
    grid = (triton.cdiv(M, tiles["block_m"]), triton.cdiv(N, tiles["block_n"]), splits)
    _w4a16_kernel[grid](
        x, packed, scale, zero if zero is not None else dummy, code if code is not None else dummy, out, M, N, K,
        n_tiles, per_split,
        x.stride(0), x.stride(1), packed.stride(0), packed.stride(1), scale.stride(0), scale.stride(1),
        M * N if splits > 1 else 0, out.stride(-2), out.stride(-1),
        GROUP=group, MODE=mode, BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], BLOCK_K=block_k,
        UPCAST=INTERPRETED and x.dtype == torch.bfloat16,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )
    return sum_splits(out, y)
