"""Where the time goes: FLOPs and bytes per token, the machine's measured limits, the bound.

Decode of one token at batch 1 reads every weight once (matrix x vector: 2 FLOPs per weight,
i.e. ~0.5 FLOP per fp32 byte), so its speed is bounded by memory bandwidth:
    tokens/s <= bandwidth / bytes_per_token.
Prefill of T tokens reads the weights once for all T (matrix x matrix: 2T FLOPs per weight),
so it is bounded by FLOP/s. The ridge point FLOP/s / bandwidth says which regime you are in.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .benchmarks.common import time_median
from .model import ModelConfig

# Published peak figures (dense bf16 TFLOP/s, HBM TB/s) quoted by the article and vendor sheets.
GPUS = {
    "A100 80GB": {"flops": 312e12, "bandwidth": 2.0e12},
    "H100 SXM": {"flops": 989e12, "bandwidth": 3.35e12},
    "H200": {"flops": 989e12, "bandwidth": 4.8e12},
}

# Published model shapes, from each model's config.json on the Hugging Face Hub (meta-llama/Llama-2-7b-hf,
# Llama-2-70b-hf, Meta-Llama-3-8B, Meta-Llama-3-70B, Llama-3.1-70B): hidden_size, num_hidden_layers,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size, max_position_embeddings.
LLAMA2_7B = ModelConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, head_dim=128,
                        ffn_dim=11008, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False)
LLAMA2_70B = ModelConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                         ffn_dim=28672, rope_theta=10000.0, max_seq_len=4096, tie_embeddings=False)
LLAMA3_8B = ModelConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                        ffn_dim=14336, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False)
LLAMA3_70B = ModelConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, head_dim=128,
                         ffn_dim=28672, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False)
LLAMA31_70B = dataclasses.replace(LLAMA3_70B, max_seq_len=131072)    # same weights' shape, 128K context
# meta-llama/Llama-3.2-1B's config.json; its "llama3" RoPE frequency scaling is not modelled here (same
# shapes and cost; the values would differ, and these models are random-weight speed stand-ins)
LLAMA32_1B = ModelConfig(vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, head_dim=64,
                         ffn_dim=8192, rope_theta=500000.0, max_seq_len=131072, tie_embeddings=True)
PUBLISHED = {"llama2-7b": LLAMA2_7B, "llama3-8b": LLAMA3_8B, "llama3.2-1b": LLAMA32_1B}   # model.published_model


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


def ridge_point(gpu: str) -> float:
    """FLOP/byte at which a GPU's peak arithmetic and peak bandwidth take equal time: a kernel doing
    fewer FLOPs per byte waits for memory (bandwidth-bound), one doing more waits for arithmetic."""
    return GPUS[gpu]["flops"] / GPUS[gpu]["bandwidth"]


def decode_step_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, batch: int = 1,
                        context: int = 0) -> float:
    """Roofline time of one decode step of `batch` sequences with `context` cached tokens each: the
    slower of its FLOPs at peak FLOP/s and its bytes (weights once, every sequence's KV) at peak
    bandwidth. A floor: real kernels reach neither peak. batch / this = the tokens/s bound."""
    flops = batch * decode_flops_per_token(cfg, context)
    nbytes = decode_bytes_per_step(cfg, bytes_per_param, context, batch)
    return max(flops / GPUS[gpu]["flops"], nbytes / GPUS[gpu]["bandwidth"])


def compute_bound_batch(cfg: ModelConfig, gpu: str, bytes_per_param: float, context: int = 0) -> float:
    """Smallest batch whose decode step does at least the GPU's ridge point in FLOPs per byte, i.e.
    where decode stops being bandwidth-bound: batch x FLOPs / (weights + batch x KV) >= ridge.
    Every sequence brings its own KV bytes with its FLOPs, so at long context the intensity levels
    off below the ridge and the answer is math.inf: decode never turns compute-bound."""
    ridge = ridge_point(gpu)
    margin = decode_flops_per_token(cfg, context) - ridge * context * kv_bytes_per_token(cfg, bytes_per_param)
    if margin <= 0:
        return math.inf
    return math.ceil(ridge * weight_bytes(cfg, bytes_per_param) / margin)


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """One causal prefill of `tokens` tokens: 2 FLOPs per weight per token, plus attention, where
    token t reads t + 1 keys (decode_flops_per_token summed over the prompt)."""
    attention = 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * tokens * (tokens + 1)
    return 2 * cfg.num_parameters() * tokens + attention


def prefill_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, tokens: int) -> float:
    """Roofline time of a batch-1 prefill: the slower of its FLOPs at peak and its bytes (weights
    once, the KV it writes) at peak bandwidth. The floor under the time to first token."""
    nbytes = weight_bytes(cfg, bytes_per_param) + tokens * kv_bytes_per_token(cfg, bytes_per_param)
    return max(prefill_flops(cfg, tokens) / GPUS[gpu]["flops"], nbytes / GPUS[gpu]["bandwidth"])


def max_sequences(cfg: ModelConfig, memory_bytes: float, seq_len: int, bytes_per_param: float,
                  kv_bytes_per_value: float | None = None) -> int:
    """How many sequences of seq_len tokens fit in memory_bytes beside the weights, if every one
    reserves its whole KV cache (activations and fragmentation ignored); 0 if the weights alone do
    not fit. kv_bytes_per_value defaults to the weights' bytes per value."""
    kv_value = bytes_per_param if kv_bytes_per_value is None else kv_bytes_per_value
    free = memory_bytes - weight_bytes(cfg, bytes_per_param)
    return max(0, int(free // (seq_len * kv_bytes_per_token(cfg, kv_value))))


class BandwidthProbe:
    """Read bandwidth, sampled again and again while a benchmark runs.

    A VM's memory bandwidth is not a constant: on the 2-core VM of lesson 01 the two threads'
    read rate moved between ~45 and ~80 GB/s, sometimes within a second (bench roofline records
    a series of samples: summary.bandwidth_over_time). A bound taken from one sample is low whenever that sample lands
    on the slow level, and every "fraction of the bound" above it then flatters. So a benchmark
    that interleaves its timed systems interleaves probe.sample() with them too, and states its
    bound from the fastest sample (what the machine did read in that run); the samples go in the
    JSON beside it.

    One sample is the faster of (a) torch.mv, decode's own access pattern through the library's
    GEMV, and (b) a plain read of the same bytes (a sum over them, viewed as fp32). No GEMV beats
    the read by much, but a library GEMV can fall far short of it (lesson 01: on one VM, a compiled
    GEMV beat a bound taken from (a) alone). The matrix is allocated once and reused.
    """

    def __init__(self, mbytes: int = 512, dtype=torch.float32, device="cpu"):
        elem = torch.tensor([], dtype=dtype).element_size()
        cols = 4096
        self.device = device
        self.weight = torch.randn(mbytes * 2**20 // (elem * cols), cols, dtype=dtype, device=device)   # (rows, cols)
        self.x = torch.randn(cols, dtype=dtype, device=device)                                         # (cols,)
        self.nbytes = self.weight.numel() * elem
        self.samples: list[float] = []                                    # bytes/s, in the order taken

    def sample(self, repeats: int = 5) -> float:
        """Bytes/s now; also kept in self.samples."""
        gemv = self.nbytes / time_median(lambda: torch.mv(self.weight, self.x), repeats, device=self.device)
        as_fp32 = self.weight.view(torch.float32)                         # same bytes, fp32 adder
        read = self.nbytes / time_median(lambda: as_fp32.sum(), repeats, device=self.device)
        self.samples.append(max(gemv, read))
        return self.samples[-1]

    @property
    def best(self) -> float:
        """The fastest sample: the bandwidth bound's denominator."""
        if not self.samples:
            raise RuntimeError("BandwidthProbe.best before any sample(): call sample() first")
        return max(self.samples)


def measure_bandwidth(mbytes: int = 512, dtype=torch.float32, repeats: int = 5, device="cpu") -> float:
    """Bytes/s at which a large weight can be streamed once, one sample (BandwidthProbe: where the
    machine's bandwidth moves, sample it between the timed runs instead)."""
    return BandwidthProbe(mbytes, dtype, device).sample(repeats)


def measure_flops(n: int = 2048, dtype=torch.float32, repeats: int = 5, device="cpu") -> float:
    """FLOP/s of a square matmul: what prefill can reach."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n**3 / time_median(lambda: a @ b, repeats, device=device)


class GemmProbe:
    """GEMM rates by route (measure_gemm_rates), sampled again and again while a benchmark runs: like the
    bandwidth, the rate a VM's cores reach moves during a run (bench engine-step saw a bf16 2048 GEMM at
    about half its earlier rate in a later run). A bound states the fastest sample of each route."""

    def __init__(self, n: int = 2048, dtype=torch.float32):
        self.n, self.dtype = n, dtype
        self.samples: list[dict[str, float]] = []                         # FLOP/s by route, in the order taken

    def sample(self, repeats: int = 3) -> dict[str, float]:
        self.samples.append(measure_gemm_rates(self.n, self.dtype, repeats))
        return self.samples[-1]

    @property
    def best(self) -> dict[str, float]:
        """Each route's fastest sample."""
        if not self.samples:
            raise RuntimeError("GemmProbe.best before any sample(): call sample() first")
        return {route: max(s[route] for s in self.samples) for route in self.samples[0]}


def measure_gemm_rates(n: int = 2048, dtype=torch.float32, repeats: int = 5) -> dict[str, float]:
    """FLOP/s of a square (n x n) GEMM on the CPU by each route: torch's a @ b and each library that
    can prepack the weight (minillm/prepacked.py). The fastest is what the machine can do; a @ b alone
    can understate it by 2x or more (lesson 07: MKL's fp32 GEMM on an AMD CPU)."""
    from . import prepacked

    rates = {"torch a @ b": measure_flops(n, dtype=dtype, repeats=repeats)}
    w, x = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)    # (out, in), (n rows, in)
    for library in prepacked.libraries_for(w):
        packed = prepacked.PrepackedLinear(w, n, library)
        rates[library] = 2 * n ** 3 / time_median(lambda: packed(x), repeats)
    return rates
