"""Where the time goes: FLOPs and bytes per token, the machine's measured limits, the bound.

Decode of one token at batch 1 reads every weight once (matrix x vector: 2 FLOPs per weight,
i.e. ~0.5 FLOP per fp32 byte), so its speed is bounded by memory bandwidth:
    tokens/s <= bandwidth / bytes_per_token.
Prefill of T tokens reads the weights once for all T (matrix x matrix: 2T FLOPs per weight),
so it is bounded by FLOP/s. The ridge point FLOP/s / bandwidth says which regime you are in.
"""
from __future__ import annotations

import torch

from .benchmarks.common import time_median
from .model import ModelConfig

# Published peak figures (dense bf16 TFLOP/s, HBM TB/s) quoted by the article and vendor sheets.
GPUS = {
    "A100 80GB": {"flops": 312e12, "bandwidth": 2.0e12},
    "H100 SXM": {"flops": 989e12, "bandwidth": 3.35e12},
    "H200": {"flops": 989e12, "bandwidth": 4.8e12},
}


def weight_bytes(cfg: ModelConfig, bytes_per_param: float) -> float:
    return cfg.num_parameters() * bytes_per_param


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_value


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """2 FLOPs per weight (multiply + add) plus attention's q.k and p.v over `context` keys."""
    attention = 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return 2 * cfg.num_parameters() + attention


def decode_bytes_per_step(cfg: ModelConfig, bytes_per_param: float, context: int, batch: int = 1) -> float:
    """One decode step for `batch` sequences: all weights once + every sequence's KV cache."""
    return weight_bytes(cfg, bytes_per_param) + batch * context * kv_bytes_per_token(cfg, bytes_per_param)


def arithmetic_intensity(cfg: ModelConfig, bytes_per_param: float, tokens_per_weight_read: int,
                         context: int = 0) -> float:
    """FLOPs per byte moved when `tokens_per_weight_read` tokens share one pass over the weights
    (1 for batch-1 decode, T for a T-token prefill, B for batch-B decode)."""
    flops = tokens_per_weight_read * decode_flops_per_token(cfg, context)
    return flops / decode_bytes_per_step(cfg, bytes_per_param, context, 1)


def measure_bandwidth(mbytes: int = 512, dtype=torch.float32, repeats: int = 5, device="cpu") -> float:
    """Bytes/s at which a large weight can be streamed once: the bound's denominator. The faster of
    (a) torch.mv, decode's own access pattern through the library's GEMV, and (b) a plain read of
    the same bytes (a sum over them, viewed as fp32). No GEMV beats the read by much, but a library
    GEMV can fall far short of it (lesson 01: on one VM, a compiled GEMV beat a bound taken from
    (a) alone)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    cols = 4096
    rows = mbytes * 2**20 // (elem * cols)
    w = torch.randn(rows, cols, dtype=dtype, device=device)
    x = torch.randn(cols, dtype=dtype, device=device)
    nbytes = rows * cols * elem
    gemv = nbytes / time_median(lambda: torch.mv(w, x), repeats, device=device)
    as_fp32 = w.view(torch.float32)                                       # same bytes, fp32 adder
    read = nbytes / time_median(lambda: as_fp32.sum(), repeats, device=device)
    return max(gemv, read)


def measure_flops(n: int = 2048, dtype=torch.float32, repeats: int = 5, device="cpu") -> float:
    """FLOP/s of a square matmul: what prefill can reach."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / time_median(lambda: a @ b, repeats, device=device)
