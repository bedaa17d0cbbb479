"""Where the time goes: FLOPs and bytes per token, the machine's measured limits, the bound.

Decode of one token at batch 1 reads every weight once (matrix x vector: 2 FLOPs per weight,
i.e. ~0.5 FLOP per fp32 byte; an untied input embedding is the exception, a gather of one row at
0 FLOPs), so its speed is bounded by memory bandwidth:
    tokens/s <= bandwidth / bytes_per_token.
Prefill of T tokens reads the weights once for all T (matrix x matrix: 2T FLOPs per weight),
so it is bounded by FLOP/s. The ridge point FLOP/s / bandwidth says which regime you are in.
"""
from __future__ import annotations

import math

import torch

from minillm.model.llama import ModelConfig
from minillm.model.shapes import (SMOLLM2_135M, LLAMA2_7B, LLAMA2_13B, LLAMA2_70B, LLAMA3_8B, LLAMA3_70B, LLAMA31_70B,
                                  LLAMA32_1B, QWEN25_7B, QWEN3_8B, MISTRAL_7B, MISTRAL_7B_WINDOW, PUBLISHED)  # noqa: F401  (lessons count with them)
from .timing import time_median

# Published peak figures from NVIDIA's datasheets: dense bf16 Tensor Core FLOP/s (the sheets' larger
# "with sparsity" figures are 2x these) and HBM bandwidth. A100 80GB SXM: 312 TFLOPS, HBM2e 2,039 GB/s;
# H100 SXM: 989 TFLOPS (1,979 with sparsity), HBM3 3.35 TB/s; H200 SXM: 989 TFLOPS, HBM3e 4.8 TB/s.
GPUS = {
    "A100 80GB": {"flops": 312e12, "bandwidth": 2.039e12},
    "H100 SXM": {"flops": 989e12, "bandwidth": 3.35e12},
    "H200": {"flops": 989e12, "bandwidth": 4.8e12},
}



def weight_bytes(cfg: ModelConfig, bytes_per_param: float) -> float:
    """Bytes the weights occupy in memory: every parameter, the whole input embedding included."""
    return cfg.num_parameters() * bytes_per_param


def lookup_parameters(cfg: ModelConfig) -> int:
    """Parameters that are only gathered, never multiplied: an untied model's input embedding
    (vocab x dim), of which a token reads one row and does 0 FLOPs. A tied model (SmolLM2, Llama-3.2-1B)
    has none: its one vocab x dim matrix is also the LM head, a matmul that reads all of it."""
    return 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.dim


def lm_head_parameters(cfg: ModelConfig) -> int:
    """The LM head's vocab x dim weights (the shared embedding matrix when tied)."""
    return cfg.vocab_size * cfg.dim


def weight_bytes_read(cfg: ModelConfig, bytes_per_param: float, tokens: int = 1) -> float:
    """Weight bytes one forward pass over `tokens` tokens reads: every weight once, except that of an
    untied input embedding only the looked-up rows (`tokens` of them, at most vocab). Tied: the LM head
    reads the whole shared matrix, which holds the looked-up rows, so all weights once."""
    rows = min(tokens, cfg.vocab_size) * cfg.dim if lookup_parameters(cfg) else 0
    return (cfg.num_parameters() - lookup_parameters(cfg) + rows) * bytes_per_param


def kv_bytes_per_token(cfg: ModelConfig, bytes_per_value: float) -> float:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * bytes_per_value


def decode_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """2 FLOPs (multiply + add) per weight that multiplies the token's activations: the layers, the
    final norm and the LM head; the input embedding lookup is a gather, 0 FLOPs (lookup_parameters).
    Plus attention's q.k and p.v over `context` keys: 2 x 2 x layers x heads x head_dim x context."""
    attention = 2 * 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * context
    return 2 * (cfg.num_parameters() - lookup_parameters(cfg)) + attention


def decode_bytes_per_step(cfg: ModelConfig, bytes_per_param: float, context: int, batch: int = 1) -> float:
    """One decode step for `batch` sequences: the weights once (of an untied input embedding, only
    the batch's looked-up rows: weight_bytes_read) + every sequence's KV cache."""
    return weight_bytes_read(cfg, bytes_per_param, batch) + batch * context * kv_bytes_per_token(cfg, bytes_per_param)


def arithmetic_intensity(cfg: ModelConfig, bytes_per_param: float, tokens_per_weight_read: int,
                         context: int = 0) -> float:
    """FLOPs per byte moved when `tokens_per_weight_read` tokens share one pass over the weights
    (1 for batch-1 decode, T for a T-token prefill, B for batch-B decode), each doing a decode
    token's FLOPs (decode_flops_per_token, LM head included), with one sequence's KV of `context`
    tokens read."""
    flops = tokens_per_weight_read * decode_flops_per_token(cfg, context)
    nbytes = weight_bytes_read(cfg, bytes_per_param, tokens_per_weight_read) + context * kv_bytes_per_token(
        cfg, bytes_per_param)
    return flops / nbytes


def ridge_point(gpu: str) -> float:
    """FLOP/byte at which a GPU's peak arithmetic and peak bandwidth take equal time: a kernel doing
    fewer FLOPs per byte waits for memory (bandwidth-bound), one doing more waits for arithmetic."""
    return GPUS[gpu]["flops"] / GPUS[gpu]["bandwidth"]


def decode_step_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, batch: int = 1,
                        context: int = 0) -> float:
    """Roofline time of one decode step of `batch` sequences with `context` cached tokens each: the
    slower of its FLOPs at peak FLOP/s and its bytes (decode_bytes_per_step: weights once, every
    sequence's KV) at peak bandwidth. A floor: real kernels reach neither peak. batch / this = the
    tokens/s bound."""
    flops = batch * decode_flops_per_token(cfg, context)
    nbytes = decode_bytes_per_step(cfg, bytes_per_param, context, batch)
    return max(flops / GPUS[gpu]["flops"], nbytes / GPUS[gpu]["bandwidth"])


def compute_bound_batch(cfg: ModelConfig, gpu: str, bytes_per_param: float, context: int = 0) -> float:
    """Smallest batch whose decode step does at least the GPU's ridge point in FLOPs per byte, i.e.
    where decode stops being bandwidth-bound: batch x FLOPs / decode_bytes_per_step >= ridge, the
    bytes being the shared weights plus, per sequence, its KV and (untied) its embedding row.
    Every sequence brings its own KV bytes with its FLOPs, so at long context the intensity levels
    off below the ridge and the answer is math.inf: decode never turns compute-bound."""
    ridge = ridge_point(gpu)
    per_sequence = context * kv_bytes_per_token(cfg, bytes_per_param)
    if lookup_parameters(cfg):
        per_sequence += cfg.dim * bytes_per_param                       # its looked-up embedding row
    shared = (cfg.num_parameters() - lookup_parameters(cfg)) * bytes_per_param
    margin = decode_flops_per_token(cfg, context) - ridge * per_sequence
    if margin <= 0:
        return math.inf
    return math.ceil(ridge * shared / margin)


def prefill_attention_flops(cfg: ModelConfig, tokens: int) -> float:
    """Causal attention of a `tokens`-token prefill: token t does q.k and p.v (2 FLOPs each) over t + 1
    keys per head and head_dim value, 2 x 2 x layers x heads x head_dim x (1 + 2 + ... + tokens)."""
    return 2 * cfg.n_layers * cfg.n_heads * cfg.head_dim * tokens * (tokens + 1)


def prefill_flops(cfg: ModelConfig, tokens: int) -> float:
    """One causal prefill of `tokens` tokens: 2 FLOPs per layer weight (and final norm gain) per token,
    the LM head for the last token only (the one whose logits pick the first new token; lesson 02),
    no FLOPs for the embedding lookup, plus causal attention (prefill_attention_flops)."""
    body = cfg.num_parameters() - lookup_parameters(cfg) - lm_head_parameters(cfg)
    return 2 * body * tokens + 2 * lm_head_parameters(cfg) + prefill_attention_flops(cfg, tokens)


def prefill_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, tokens: int) -> float:
    """Roofline time of a batch-1 prefill: the slower of its FLOPs at peak and its bytes (weights
    once, weight_bytes_read, and the KV it writes) at peak bandwidth. The floor under the time to
    first token."""
    nbytes = weight_bytes_read(cfg, bytes_per_param, tokens) + tokens * kv_bytes_per_token(cfg, bytes_per_param)
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
    read rate moved between two levels, the faster nearly twice the slower, sometimes within a second (bench roofline records
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
    can prepack the weight (minillm/model/prepacked.py). The fastest is what the machine can do; a @ b alone
    can understate it by 2x or more (lesson 07: MKL's fp32 GEMM on an AMD CPU)."""
    from minillm.model import prepacked

    rates = {"torch a @ b": measure_flops(n, dtype=dtype, repeats=repeats)}
    w, x = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)    # (out, in), (n rows, in)
    for library in prepacked.libraries_for(w):
        packed = prepacked.PrepackedLinear(w, n, library)
        rates[library] = 2 * n ** 3 / time_median(lambda: packed(x), repeats)
    return rates


# --------------------------------------------------------------------------- speculation under load, KV included
# (lesson 08 §4). A verification of k drafts runs 1 + k query rows per request against the same cached
# context, so it multiplies the step's FLOPs by 1 + k but reads each request's KV only once: the KV bytes,
# which grow with batch x context, are paid by plain and speculative steps alike.

def expected_tokens_per_call(alpha: float, k: int) -> float:
    """Tokens one request gets from one verification of k drafts, each accepted with probability alpha
    (Leviathan et al. 2023): 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def speculative_step_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, batch: int, context: int,
                             k: int) -> float:
    """Roofline time of one engine step where each of `batch` requests (`context` cached tokens) runs its
    pending token and k drafts: (1 + k) x the FLOPs of a plain step, the same bytes (weights once, every
    request's KV once; the 1 + k new K/V rows are negligible). Drafting itself is taken as free. k = 0 is
    decode_step_seconds."""
    flops = batch * (1 + k) * decode_flops_per_token(cfg, context)
    nbytes = decode_bytes_per_step(cfg, bytes_per_param, context, batch)
    return max(flops / GPUS[gpu]["flops"], nbytes / GPUS[gpu]["bandwidth"])


def speculative_roofline_speedup(cfg: ModelConfig, gpu: str, bytes_per_param: float, batch: int, context: int,
                                 alpha: float, k: int) -> float:
    """Throughput with k drafts per request over plain decoding at `batch` requests of `context` tokens:
    E(alpha, k) tokens per request-step, for speculative_step_seconds instead of decode_step_seconds."""
    plain = speculative_step_seconds(cfg, gpu, bytes_per_param, batch, context, 0)
    return expected_tokens_per_call(alpha, k) * plain / speculative_step_seconds(cfg, gpu, bytes_per_param,
                                                                               batch, context, k)


def speculative_crossover_batch(cfg: ModelConfig, gpu: str, bytes_per_param: float, context: int,
                                alpha: float, k: int) -> float:
    """The batch at which speculative_roofline_speedup falls to 1, KV bytes included; math.inf if it never does.

    With W the weight bytes, m the bytes each request adds (its KV), F the FLOPs per token, P the peak
    FLOP/s and BW the bandwidth: the speedup can only reach 1 where the speculative step is compute-bound
    and the plain one still memory-bound, E (W + B m) / BW = (1 + k) B F / P, so
        B = E W R / ((1 + k) F - E R m),   R = P / BW the ridge point.
    At context 0 (m = 0) this is ridge_tokens x E / (1 + k), the KV-free calculators.crossover_batch.
    When E R m >= (1 + k) F the KV traffic keeps even the speculative step memory-bound at every batch:
    speculation pays E at any batch (until memory runs out: max_sequences)."""
    ridge = ridge_point(gpu)
    e = expected_tokens_per_call(alpha, k)
    weights = decode_bytes_per_step(cfg, bytes_per_param, context, 0)
    per_request = decode_bytes_per_step(cfg, bytes_per_param, context, 1) - weights
    margin = (1 + k) * decode_flops_per_token(cfg, context) - e * ridge * per_request
    if margin <= 0:
        return math.inf
    return e * ridge * weights / margin


def speculation_always_pays_context(cfg: ModelConfig, gpu: str, bytes_per_param: float, alpha: float,
                                    k: int) -> float:
    """The context (tokens per request, a real number) from which speculative_crossover_batch is
    math.inf: beyond it no batch size makes k drafts at acceptance alpha cost throughput (roofline,
    drafting free). The crossover's denominator (1 + k) F(L) - E R m(L) is linear in the context L:
    F(L) = F0 + f L, m(L) = m0 + kv L, so it changes sign at L = ((1 + k) F0 - E R m0) / (E R kv - (1 + k) f);
    math.inf if it never does (0 if it is never positive)."""
    ridge, e = ridge_point(gpu), expected_tokens_per_call(alpha, k)

    def per_request(context: int) -> float:
        return (decode_bytes_per_step(cfg, bytes_per_param, context, 1)
                - decode_bytes_per_step(cfg, bytes_per_param, context, 0))

    f0, f = decode_flops_per_token(cfg, 0), decode_flops_per_token(cfg, 1) - decode_flops_per_token(cfg, 0)
    m0, kv = per_request(0), per_request(1) - per_request(0)
    at_zero, slope = (1 + k) * f0 - e * ridge * m0, e * ridge * kv - (1 + k) * f
    if at_zero <= 0:
        return 0.0
    return math.inf if slope <= 0 else at_zero / slope


# ------------------------------------------------------------------- lesson 04: a W4A16 GEMV's instruction budget
# Published: NVIDIA H100 Tensor Core GPU Architecture whitepaper (GH100; the H200 is the same chip with HBM3e):
# H100 SXM5 has 132 SMs with 128 FP32 cores each (16,896 in all) and a peak FP32 rate of 66.9 TFLOPS; each SM is
# four processing blocks, each with one warp scheduler that issues one warp instruction (32 threads) per clock.
HOPPER_SXM = {"sms": 132, "fp32_cores": 16896, "fp32_flops": 66.9e12, "warp_schedulers_per_sm": 4}
W4A16_G128_BITS = 4 + (16 + 8) / 128     # int4 codes + an fp16 scale and an 8-bit zero point per group of 128


def boost_clock_hz(chip: dict = HOPPER_SXM) -> float:
    """The clock the published FP32 peak assumes: one FMA (2 FLOPs) per FP32 core per clock."""
    return chip["fp32_flops"] / (2 * chip["fp32_cores"])


def gemv_instruction_budget(gpu: str = "H200", bits_per_weight: float = W4A16_G128_BITS,
                            chip: dict = HOPPER_SXM) -> float:
    """Thread instructions per weight a batch-1 GEMV may issue and still keep up with the memory: the chip
    issues 32 x schedulers x SMs thread instructions per clock at clock f, and the memory delivers
    B / b weights per second (b bytes per weight), so the budget is 128 f S b / B for Hopper's 4 schedulers.
    A loop that issues more per weight is bound by instruction issue, not by bandwidth."""
    threads_per_second = 32 * chip["warp_schedulers_per_sm"] * chip["sms"] * boost_clock_hz(chip)
    weights_per_second = GPUS[gpu]["bandwidth"] / (bits_per_weight / 8)
    return threads_per_second / weights_per_second


def gemv_bandwidth_share(instructions_per_weight: float, gpu: str = "H200",
                         bits_per_weight: float = W4A16_G128_BITS, chip: dict = HOPPER_SXM) -> float:
    """The largest share of peak bandwidth a GEMV loop issuing `instructions_per_weight` can reach
    (1.0 when it fits in the budget): every SM busy, boost clock, nothing but the loop counted."""
    return min(1.0, gemv_instruction_budget(gpu, bits_per_weight, chip) / instructions_per_weight)




def windowed_kv_bytes(cfg: ModelConfig, bytes_per_value: float, tokens: int, window: int | None) -> float:
    """K and V bytes one sequence of `tokens` needs: every token's, or only the last `window` ones where each
    layer attends back that far (a rolling buffer; Mistral 7B)."""
    kept = tokens if window is None else min(tokens, window)
    return kv_bytes_per_token(cfg, bytes_per_value) * kept


def tensor_parallel_step_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, gpus: int, batch: int = 1,
                                 context: int = 0) -> float:
    """Roofline time of one decode step with the weights, the KV cache and the FLOPs split evenly over `gpus`
    GPUs that work at the same time (tensor parallelism), communication left out: decode_step_seconds / gpus,
    a floor. Layers split over GPUs that run one after another (a pipeline at batch 1, such as transformers'
    device_map="auto") get no such division: each GPU waits for the one before, so that step is
    decode_step_seconds itself, however many GPUs hold the layers."""
    return decode_step_seconds(cfg, gpu, bytes_per_param, batch, context) / gpus


def batch_for_throughput(cfg: ModelConfig, gpu: str, bytes_per_param: float, tokens_per_second: float,
                         context: int = 0) -> float:
    """Smallest decode batch whose roofline throughput (batch / decode_step_seconds, every sequence with
    `context` cached tokens) reaches `tokens_per_second` in all; math.inf if no batch does (the compute
    roof, or every sequence's KV bytes, caps the throughput below it). A floor: real kernels reach neither
    peak, so a real engine needs a larger batch. Memory is not checked (max_sequences)."""
    def rate(batch: int) -> float:
        return batch / decode_step_seconds(cfg, gpu, bytes_per_param, batch, context)

    hi = 1
    while rate(hi) < tokens_per_second:
        if hi >= 2 ** 24:
            return math.inf
        hi *= 2
    lo = hi // 2                                                    # rate(lo) < target (or lo = 0)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if rate(mid) >= tokens_per_second else (mid, hi)
    return hi


def generation_seconds(cfg: ModelConfig, gpu: str, bytes_per_param: float, prompt: int, new_tokens: int,
                       use_cache: bool = True) -> float:
    """Roofline time to generate `new_tokens` greedy tokens after a `prompt`-token prompt at batch 1, a floor.
    With a KV cache: one prefill of the prompt, then new_tokens - 1 decode steps, step i reading prompt + i
    cached tokens. Without one (kv_cache.generate_greedy_naive): step i is a prefill of all prompt + i
    positions (the token positions of calculators.positions_computed). On a GPU a short recompute is itself
    bandwidth-bound (it reads the weights once, like a decode step), so the cache's gain starts small and
    grows once the recomputed positions pass the ridge point."""
    if use_cache:
        return prefill_seconds(cfg, gpu, bytes_per_param, prompt) + sum(
            decode_step_seconds(cfg, gpu, bytes_per_param, 1, prompt + i) for i in range(1, new_tokens))
    return sum(prefill_seconds(cfg, gpu, bytes_per_param, prompt + i) for i in range(new_tokens))


def prefill_compute_bound_tokens(cfg: ModelConfig, gpu: str, bytes_per_param: float) -> int:
    """Shortest prompt whose batch-1 prefill_seconds is set by its FLOPs rather than by its bytes: below it a
    prefill, like a decode step, mostly waits for the weights to stream in (a T-token prefill does about T
    FLOPs per 2-byte weight, so this is near the GPU's ridge point in tokens)."""
    def compute_bound(tokens: int) -> bool:
        nbytes = weight_bytes_read(cfg, bytes_per_param, tokens) + tokens * kv_bytes_per_token(cfg, bytes_per_param)
        return prefill_flops(cfg, tokens) / GPUS[gpu]["flops"] >= nbytes / GPUS[gpu]["bandwidth"]

    hi = 1
    while not compute_bound(hi):
        hi *= 2
    lo = hi // 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if compute_bound(mid) else (mid, hi)
    return hi
