"""The CPU decode attention kernel (cpu_decode.c), built on first use and called through ctypes.

    out = decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window=None)   # (B, Hq, D)

The contract of attention.paged.decode_attention_fused (the loops Inductor generates from PyTorch ops),
written by hand for the reason vLLM's CPU backend has a C++ attention kernel. The generated loops reduce
each D-long dot product across a vector register once per key and query head, recompute the block
index with a bounds check per key, and read each key and value once per query head of a GQA group; the
hand-written loop reads each key and value row once for the whole group and only up to each row's own
length, so one call takes every decode row however their lengths differ (cpu_decode.c's comment).

The library is built once per source and CPU into the model cache (loader.cache_dir()/kernels) by
kernel_support/c_library.py. Where it cannot be built, kernel() says why and the engine keeps the compiled PyTorch kernel
(attention.backends.choose_backend). A GPU runs kernels/paged_attention.py's Triton kernel instead.

The engine calls it as the op minillm::cpu_decode_attention, so that the torch profiler (bench profile,
bench peers) sees the kernel's time as an op of its own instead of Python between ops, and so that a compiled
step of decode rows only keeps the call inside its graph (layer.decode_only_layer).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from minillm.kernel_support import c_library

SOURCE = Path(__file__).with_name("cpu_decode.c")
DTYPES = {torch.float32: 0, torch.bfloat16: 1}     # cpu_decode.c's F32, BF16
MAX_G, MAX_D, MAX_BLOCK = 16, 256, 256             # cpu_decode.c's limits (query heads per KV head, head size, block)


def library_path() -> Path:
    return c_library.cache_path(SOURCE)


@functools.cache
def kernel() -> tuple[ctypes.CDLL | None, str | None]:
    """-> (the loaded library, None), or (None, why it could not be built or loaded)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    return c_library.load(SOURCE, library_path(), "decode_attention", [ptr] * 6 + [ctypes.c_int] + [i64] * 7 + [ctypes.c_float, i64, ctypes.c_int])


def supports(n_heads: int, k_cache: torch.Tensor) -> bool:
    """The kernel takes a cache of this dtype and layout (k_cache (..., block_size, Hkv, D): one layer's or
    all layers') with n_heads query heads: CPU, fp32 or bf16, D a multiple of 16, within its limits."""
    block_size, Hkv, D = k_cache.shape[-3:]
    return (k_cache.device.type == "cpu" and k_cache.dtype in DTYPES and n_heads % Hkv == 0
            and n_heads // Hkv <= MAX_G and D % 16 == 0 and D <= MAX_D and block_size <= MAX_BLOCK)


def usable(n_heads: int, k_cache: torch.Tensor) -> bool:
    """The engine can attend with the kernel here: it takes the layout and it builds."""
    return supports(n_heads, k_cache) and kernel()[0] is not None


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """q (B, Hq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D); block_tables (B, n) and seq_lens (B,)
    keys per row (>= 1), int32 (others are converted) -> (B, Hq, D) in q's dtype, computed in fp32 with the
    1/sqrt(D) scale. window: each row sees only its last `window` keys."""
    lib, why = kernel()
    if lib is None:
        raise RuntimeError(f"the CPU decode attention kernel is not available here: {why}")
    if (q.dim() != 3 or not supports(q.shape[1], k_cache) or not q.dtype == k_cache.dtype == v_cache.dtype
            or q.shape[2] != k_cache.shape[3] or v_cache.shape != k_cache.shape or q.device.type != "cpu"):
        raise ValueError(f"cpu_decode takes q (B, Hq, D) and caches (blocks, block_size, Hkv, D) on CPU in one dtype "
                         f"(fp32 or bf16), D a multiple of 16 up to {MAX_D}, at most {MAX_G} query heads per KV head, "
                         f"blocks of at most {MAX_BLOCK}; got q {q.dtype} {tuple(q.shape)}, k_cache {k_cache.dtype} "
                         f"{tuple(k_cache.shape)}, v_cache {v_cache.dtype} {tuple(v_cache.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window = {window!r}; allowed: None or a positive number of keys")
    q, k_cache, v_cache = q.contiguous(), k_cache.contiguous(), v_cache.contiguous()
    tables, lens = block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous()
    B, Hq, D = q.shape
    out = torch.empty_like(q)                                             # (B, Hq, D)
    failed = lib.decode_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
                                  lens.data_ptr(), out.data_ptr(), DTYPES[q.dtype], B, tables.shape[1], Hq,
                                  k_cache.shape[2], D, k_cache.shape[1], k_cache.shape[0], D ** -0.5, window or 0,
                                  torch.get_num_threads())
    if failed == 2:
        raise ValueError(f"cpu_decode: a seq_len outside 1 .. {tables.shape[1] * k_cache.shape[1]} (the table's blocks x "
                         f"block size) or a block number outside 0 .. {k_cache.shape[0] - 1}; nothing was read")
    if failed:
        raise ValueError("cpu_decode.c refused the layout")             # supports() checks the same limits
    return out


if not hasattr(torch.ops.minillm, "cpu_decode_attention"):
    _LIBRARY = torch.library.Library("minillm", "FRAGMENT")
    _LIBRARY.define("cpu_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
                    "Tensor seq_lens, int window) -> Tensor")           # window 0: none
    _LIBRARY.impl("cpu_decode_attention", lambda q, k_cache, v_cache, tables, lens, window: decode_attention(
        q, k_cache, v_cache, tables, lens, window or None), "CompositeExplicitAutograd")
    torch.library.register_fake("minillm::cpu_decode_attention", lib=_LIBRARY)(   # NEW: inside a compiled graph
        lambda q, k_cache, v_cache, tables, lens, window: torch.empty_like(q))


def decode_attention_op(q, k_cache, v_cache, block_tables, seq_lens, window: int | None = None) -> torch.Tensor:
    """decode_attention through the op minillm::cpu_decode_attention: what the engine calls."""
    return torch.ops.minillm.cpu_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window or 0)
