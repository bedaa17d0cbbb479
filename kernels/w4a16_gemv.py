"""W4A16 for decode: a 4-bit GEMV with split-K, for a few activation rows (M <= 8).

At batch 1 a matmul is a matrix-vector product: every weight is read once and used once, so the
kernel's time is the bytes it reads over the memory bandwidth, as long as unpacking the codes keeps
up. kernels/w4a16.py pads M to 16 and runs tl.dot; here each program multiplies in fp32 on the CUDA
cores and:

  * splits K: grid (N / BLOCK_N, SPLIT_K, M / BLOCK_M). A 4096-row weight with BLOCK_N = 32 gives
    128 programs, fewer than an H200's 132 SMs; splitting K gives every SM several programs, each
    keeping its own loads in flight. Each split writes fp32 partial sums (SPLIT_K, M, N); a second
    small kernel (kernels/w4a16.py:sum_splits) adds them in a fixed order, deterministic unlike atomics.
  * reads the codes as 32-bit words (8 codes each), a (BLOCK_N, WORDS) tile per step: 128-bit loads
    once Triton knows the rows are 16-byte aligned.
  * turns a code into a float without a conversion instruction: OR-ing q (< 2^23) into the bits of
    the float 2^23 (0x4B000000) gives exactly the float 2^23 + q. Subtracting 2^23 + z, not 2^23,
    leaves q - z: the zero point costs nothing per weight. The trick of FasterTransformer and Marlin
    (in fp16 with 0x6400 = 1024, two codes per 32-bit op); a conversion instruction runs at a fraction
    of the FMA rate (CUDA C++ Programming Guide, throughput of arithmetic instructions).
  * applies the group's scale once per tile and row, after the sum (a tile never spans two groups):
        sum_k x_k (q_k - z) s = s * sum_k x_k (q_k - z)
    so each weight costs a shift, one logic op (mask and OR in one LOP3), one subtraction and one
    multiply-add, and the products are summed across threads once per tile, not once per nibble.
  * at batch 1 loads each nibble's x values once per tile as a vector that every row of the tile
    shares (a broadcast in registers, no trip through shared memory), so a wider BLOCK_N converts each
    x value once for more weights.

LAYOUT says where column c of a row sits. 0: the stored format (minillm/quant/int4.py: two codes per
byte, first in the high nibble), so word j of a tile holds columns 8j .. 8j+7 and nibble i is column
8j + (i XOR 1): a step reads x at a stride of 8. 1: "interleaved", rewritten once when the layer is
prepared (minillm/quant/w4a16.py:gemv_words): within each tile of 8 * WORDS columns, nibble i of word j
is column i * WORDS + j, so nibble i of the whole tile is a contiguous run of x (vector loads). This is
the idea of Marlin's offline reshuffle (arrange the bytes for the kernel that reads them), cut down to
what a Triton kernel can use. tests/kernel_support/test_kernels_sm90.py compiles it for Hopper here and checks the
instructions it became.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.w4a16 import split_k_plan, split_output, sum_splits
from minillm.kernel_support.args import W4A16_MODES, check_kernel_device, w4a16_tile_k

FLOAT_2_POW_23 = tl.constexpr(0x4B000000)   # bits of the float 2^23: its mantissa's lowest bit is worth 1
MAX_GEMV_ROWS = 8                           # above this, tensor cores (kernels/w4a16.py) do the products


@triton.jit
def _w4a16_gemv_kernel(X, WORD, S, Z, CODE, OUT, M, N, K, n_tiles, tiles_per_split,
                       stride_xm, stride_wn, stride_sn, stride_sg, stride_os, stride_om,
                       GROUP: tl.constexpr, MODE: tl.constexpr, LAYOUT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WORDS: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                 # (BM,) rows of x
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)                 # (BN,) rows of W
    offs_w = tl.arange(0, WORDS)                                     # (WORDS,) word in the tile
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * tiles_per_split
    last = tl.minimum(first + tiles_per_split, n_tiles)
    for t in range(first, last):                                     # this split's tiles of 8 * WORDS columns
        k0 = t * (8 * WORDS)
        word = tl.load(WORD + offs_n[:, None] * stride_wn + (t * WORDS + offs_w)[None, :],
                       mask=n_ok[:, None], other=0).to(tl.uint32, bitcast=True)   # (BN, WORDS): 8 codes each
        g = k0 // GROUP                                              # the tile's group
        s = tl.load(S + offs_n * stride_sn + g * stride_sg, mask=n_ok, other=0.0).to(tl.float32)   # (BN,)
        if MODE == 1:
            z = tl.load(Z + offs_n * stride_sn + g * stride_sg, mask=n_ok, other=0).to(tl.float32)
        else:
            z = tl.full((BLOCK_N,), 8.0, tl.float32)                 # symmetric: z = 2^(4-1); unused by NF4
        if BLOCK_M == 1:
            xw = tl.zeros((BLOCK_N, WORDS), dtype=tl.float32)        # x_k (q_k - z), summed over the nibbles
        else:
            xw3 = tl.zeros((BLOCK_M, BLOCK_N, WORDS), dtype=tl.float32)
        magic_z = (z + 8388608.0)[:, None]                           # (BN, 1): 2^23 + z
        for i in tl.static_range(8):
            q = (word >> (4 * i)) & 0xF                              # (BN, WORDS) codes
            if MODE == 2:                                            # NF4: the code table's value
                w = tl.load(CODE + q)
            else:                                                    # exactly q - z, as a float
                w = (q | FLOAT_2_POW_23).to(tl.float32, bitcast=True) - magic_z
            if LAYOUT == 0:
                col = k0 + 8 * offs_w + (i + 1 - 2 * (i % 2))        # nibble i = column 8j + (i XOR 1)
            else:
                col = k0 + i * WORDS + offs_w                        # nibble i = a contiguous run
            if BLOCK_M == 1:                                         # one row of x, broadcast over W's rows
                x = tl.load(X + pid_m * stride_xm + col, mask=col < K, other=0.0).to(tl.float32)   # (WORDS,)
                xw += x[None, :] * w                                 # (BN, WORDS)
            else:
                x = tl.load(X + offs_m[:, None] * stride_xm + col[None, :],
                            mask=m_ok[:, None] & (col < K)[None, :], other=0.0).to(tl.float32)   # (BM, WORDS)
                xw3 += x[:, None, :] * w[None, :, :]                 # (BM, BN, WORDS)
        if BLOCK_M == 1:
            acc += (tl.sum(xw, axis=1) * s)[None, :]                 # one cross-thread sum per tile
        else:
            acc += tl.sum(xw3, axis=2) * s[None, :]
    out = OUT + pid_s * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out, acc.to(OUT.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def check_gemv_config(block_n: int, layout: int) -> None:
    if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n!r}")
    if layout not in (0, 1):
        raise ValueError(f"layout must be 0 (stored bytes) or 1 (interleaved words), got {layout!r}")


def w4a16_gemv(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
               code: torch.Tensor | None = None, *, group: int, layout: int = 0, block_n: int = 32,
               split_k: int = 1, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """x (M, K) with M <= 8, words int32 (N, ceil(K / tile) * tile / 8) in `layout`, scale (N, ng) or any
    strides (a transposed (ng, N) copy reads coalesced), zero like scale or None, code (16,) for NF4
    -> y (M, N) in x.dtype. tile = w4a16_tile_k(group) columns."""
    check_kernel_device(*(t for t in (x, words, scale, zero, code) if t is not None))
    check_gemv_config(block_n, layout)
    M, K = x.shape
    N = words.shape[0]
    if not 1 <= M <= MAX_GEMV_ROWS:
        raise ValueError(f"the GEMV takes 1..{MAX_GEMV_ROWS} rows of x, got {M}; use kernels.w4a16.w4a16_matmul")
    if words.dtype != torch.int32 or words.stride(1) != 1:
        raise ValueError(f"words must be int32 with contiguous rows, got {words.dtype} strides {words.stride()}")
    tile = w4a16_tile_k(group)
    n_tiles = triton.cdiv(K, tile)
    if words.shape[1] * 8 != n_tiles * tile or K % 8:
        raise ValueError(f"words has {words.shape[1]} words per row; x has K = {K} columns "
                         f"(need K % 8 == 0 and {n_tiles * tile // 8} words: whole tiles of {tile})")
    if scale.shape != (N, triton.cdiv(K, group)):
        raise ValueError(f"scale must be (N, ceil(K / group)) = {(N, triton.cdiv(K, group))}, got {tuple(scale.shape)}")
    if zero is not None and (zero.shape != scale.shape or zero.stride() != scale.stride()):
        raise ValueError(f"zero must have scale's shape and strides {tuple(scale.shape)} {scale.stride()}, "
                         f"got {tuple(zero.shape)} {zero.stride()}")          # the kernel indexes both alike
    if x.stride(1) != 1:
        x = x.contiguous()
    mode = W4A16_MODES["nf4" if code is not None else "int-zero" if zero is not None else "int-sym"]
    splits, tiles_per_split = split_k_plan(n_tiles, split_k)
    block_m = triton.next_power_of_2(M)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    out = split_output(y, splits)
    grid = (triton.cdiv(N, block_n), splits, triton.cdiv(M, block_m))
    _w4a16_gemv_kernel[grid](
        x, words, scale, zero if zero is not None else scale, code if code is not None else scale, out,
        M, N, K, n_tiles, tiles_per_split,
        x.stride(0), words.stride(0), scale.stride(0), scale.stride(1), M * N if splits > 1 else 0, N,
        GROUP=group, MODE=mode, LAYOUT=layout, BLOCK_M=block_m, BLOCK_N=block_n, WORDS=tile // 8,
        num_warps=num_warps, num_stages=num_stages)
    return sum_splits(out, y)
