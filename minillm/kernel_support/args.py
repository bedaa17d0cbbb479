"""What the Triton kernels in kernels/ share with the PyTorch code that launches them: the
interpreter switch, the constants of the kernels' arithmetic and the argument checks.

A leaf module: it imports torch and the standard library, nothing of minillm. kernels/*.py take
what they need from here and from no other minillm module, so importing a kernel does not import
the engine, and the minillm modules that launch a kernel (importing it inside a function, so a
machine without triton still runs the PyTorch twin) form no import cycle with it.
tests/test_layout.py checks both.
"""
from __future__ import annotations

import math
import os

import torch

# Triton decides when a kernel module is imported whether @triton.jit compiles (GPU) or
# interprets (CPU, numpy): TRITON_INTERPRET must be set before this module or a kernel is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634          # the kernels' softmax runs on exp2: exp(x) = exp2(x * LOG2E)
MAX_HEAD_DIM = 256                   # widest head the attention kernels tile (padded to a power of two)
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)   # what the kernels' tl.dot takes


def check_kernel_device(*tensors: torch.Tensor) -> None:
    """All tensors on one device, and one the kernels run on here: CUDA, or CPU under the interpreter."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    if INTERPRETED and device.type != "cpu":
        raise ValueError(f"TRITON_INTERPRET=1 runs kernels on CPU tensors only, got device {device}")
    if not INTERPRETED and device.type != "cuda":
        raise ValueError(f"the Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 for CPU), got device {device}")


# ----------------------------------------------------------------------------- FlashAttention

def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                           sm_scale: float | None) -> float:
    """Validate shapes, dtypes and devices of q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D);
    return the softmax scale (default 1/sqrt(D))."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 4-D tensor (B, H, T, D), got {shape}")
        if t.dtype not in KERNEL_DTYPES:
            raise ValueError(f"{name}.dtype must be one of float32, float16, bfloat16, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (B, Hkv, Tk, D), got {tuple(k.shape)} and {tuple(v.shape)}")
    B, Hq, Tq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k must be (B={B}, Hkv, Tk, D={D}) to match q, got {tuple(k.shape)}")
    Hkv, Tk = k.shape[1], k.shape[2]
    if min(B, Hq, Tq, D, Hkv, Tk) < 1:
        raise ValueError(f"all dimensions must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if Hq % Hkv != 0:
        raise ValueError(f"the number of query heads ({Hq}) must be a multiple of the KV heads ({Hkv})")
    if causal and Tq > Tk:
        raise ValueError(f"causal attention needs Tq <= Tk (query i sits at position Tk - Tq + i), got Tq={Tq}, Tk={Tk}")
    if sm_scale is None:
        return 1.0 / math.sqrt(D)
    if not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale) and sm_scale > 0):
        raise ValueError(f"sm_scale must be a positive finite number or None, got {sm_scale!r}")
    return float(sm_scale)


# ----------------------------------------------------------------------------- W4A16 matmul

W4A16_MODES = {"int-sym": 0, "int-zero": 1, "nf4": 2}     # the kernel's MODE: how a 4-bit code becomes a weight


def override_tiles(config: dict, **tiles) -> dict:
    """config with the caller's tile sizes (block_m=, block_n=; None keeps the default), each a power of two >= 16."""
    for name, value in tiles.items():
        if value is not None:
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value!r}")
            config[name] = value
    return config


def w4a16_tile_k(group: int) -> int:
    """Largest tile width in (128, 64, 32) that divides the group (a tile never spans two groups)."""
    for bk in (128, 64, 32):
        if group % bk == 0:
            return bk
    raise ValueError(f"group / block size {group} must be a multiple of 32 for the fused 4-bit matmul")


# ----------------------------------------------------------------------------- paged attention

def check_paged_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Shapes of a paged decode: q (B, Hq, D), k_cache and v_cache (num_blocks, block_size, Hkv, D),
    block_tables (B, max_blocks), seq_lens (B,)."""
    if q.dim() != 3:
        raise ValueError(f"q must be (B, Hq, D), got shape {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must both be (num_blocks, block_size, Hkv, D), got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    B, Hq, D = q.shape
    if k_cache.shape[3] != D:
        raise ValueError(f"head_dim of q ({D}) and k_cache ({k_cache.shape[3]}) differ")
    if Hq % k_cache.shape[2]:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({k_cache.shape[2]})")
    if block_tables.dim() != 2 or block_tables.shape[0] != B or tuple(seq_lens.shape) != (B,):
        raise ValueError(f"block_tables must be (B={B}, max_blocks) and seq_lens (B={B},), got "
                         f"{tuple(block_tables.shape)} and {tuple(seq_lens.shape)}")
