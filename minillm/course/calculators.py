"""The formulas the lessons, the quiz and the figures quote (their `counted by` footnotes), kept out of the
engine's modules: none of these runs while serving. Each is tested against the code it describes
(tests/stages/test_kv_cache.py, tests/kvcache/test_paged.py, tests/engine/test_scheduler.py, ...).
"""
from __future__ import annotations

import math

from minillm.engine.request import Request
from minillm.kvcache.block_manager import BlockManager
from minillm.model.llama import ModelConfig
from minillm.perf.roofline import expected_tokens_per_call, weight_bytes
from minillm.speculative.core import MAX_SPECULATIVE_TOKENS


def weight_bytes_of(name: str, bytes_per_param: float) -> float:
    """roofline.weight_bytes of a published shape by name (minillm/model/shapes.py)."""
    return weight_bytes(ModelConfig.named(name), bytes_per_param)


# Lesson 02: what a KV cache holds and saves
def kv_cache_bytes(n_layers: int, n_kv_heads: int, head_dim: int, seq_len: int, batch: int,
                   dtype_bytes: float) -> float:
    """The article's formula: 2 (K and V) x layers x kv_heads x head_dim x seq_len x batch x bytes."""
    return 2 * n_layers * n_kv_heads * head_dim * seq_len * batch * dtype_bytes


def mla_kv_cache_bytes(n_layers: int, kv_lora_rank: int, rope_head_dim: int, seq_len: int, batch: int,
                       dtype_bytes: float) -> float:
    """Multi-head latent attention (DeepSeek-V2/V3) caches, per token and layer, one latent vector
    c_KV (kv_lora_rank wide, shared by all heads' K and V) plus one RoPE key shared by all heads:
    layers x (kv_lora_rank + rope_head_dim) x seq_len x batch x bytes. No factor 2, no head count."""
    return n_layers * (kv_lora_rank + rope_head_dim) * seq_len * batch * dtype_bytes


def positions_computed(prompt_len: int, new_tokens: int, use_cache: bool) -> int:
    """Token positions pushed through the model to generate new_tokens greedy tokens after a prompt:
    what the projections and MLPs cost, in tokens. Without a cache (generate_greedy_naive) step i
    recomputes all prompt_len + i positions, quadratic in the length; with one (generate_greedy) the
    prompt runs once and every later step runs only its one new token (the last token is never fed)."""
    if use_cache:
        return prompt_len + new_tokens - 1
    return prompt_len * new_tokens + new_tokens * (new_tokens - 1) // 2


# Lessons 06 and 12: blocks and prefix hits, counted on a real BlockManager
def blocks_after_parallel_sampling(prompt_len: int, n: int, block_size: int = 16) -> int:
    """Blocks held once n samples of one prompt (n > 1 sampling) have each written their first output
    token, counted on a real BlockManager: the prompt's full blocks stay shared (fork), and only the
    partly filled last block is copied, by every writer but the last (copy-on-write)."""
    num_blocks = n * (prompt_len // block_size + 2)                        # room even without sharing
    bm = BlockManager(num_blocks, block_size)
    samples = [Request.from_token_ids(str(i), list(range(prompt_len))) for i in range(n)]
    bm.allocate(samples[0])
    for req in samples:                                                 # the prompt is computed
        req.num_computed_tokens = prompt_len
    for child in samples[1:]:
        bm.fork(samples[0].request_id, child.request_id)
    for i, req in enumerate(samples):
        req.output_token_ids.append(i)                                  # each sample's own first token
        bm.append_slots(req, req.num_tokens)
    return num_blocks - bm.num_free_blocks


def prefix_hit_tokens(shared_len: int, prompt_len: int, block_size: int = 16) -> int:
    """Tokens of a prompt_len-token prompt served by the prefix cache when an earlier request, fully
    computed, started with the same shared_len tokens; counted on a real BlockManager: whole blocks
    only, and at most prompt_len - 1 tokens, so that the last one runs and yields logits."""
    bm = BlockManager(2 * (max(shared_len, prompt_len) // block_size + 2), block_size, enable_prefix_caching=True)
    shared = list(range(shared_len))
    earlier = Request.from_token_ids("earlier", shared + [shared_len])  # then the two prompts differ
    bm.allocate(earlier)
    earlier.num_computed_tokens = earlier.num_tokens
    bm.cache_blocks(earlier)
    later = Request.from_token_ids("later", shared + [shared_len + 1] * (prompt_len - shared_len))
    return bm.cached_prefix_tokens(later)


# Lesson 07: batching
def padding_fraction(max_tokens: list[int], batch_size: int) -> float:
    """Share of the decode rows static batching computes for requests that are already done: each
    batch of batch_size requests (in order) runs as many steps as its longest request, every row every
    step (generate_static's 1 - useful_tokens / computed_tokens when no request stops early)."""
    batches = [max_tokens[i:i + batch_size] for i in range(0, len(max_tokens), batch_size)]
    return 1 - sum(max_tokens) / sum(len(b) * max(b) for b in batches)


def chunked_prefill_steps(prompt_len: int, max_num_batched_tokens: int, num_decoding: int) -> int:
    """Steps a new prompt's prefill takes beside num_decoding running requests: each step the running
    requests go first (one decode token each) and the prompt gets what is left of the token budget.
    This is the time to first token in steps, which chunked prefill trades for smooth decodes."""
    chunk = max_num_batched_tokens - num_decoding
    if chunk < 1:
        raise ValueError(f"{num_decoding} decodes fill the budget of {max_num_batched_tokens} tokens: "
                         f"the prompt never gets a chunk; allowed: num_decoding < max_num_batched_tokens")
    return -(-prompt_len // chunk)


# Lesson 08: what speculation buys
def expected_speedup(alpha: float, k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Leviathan et al.: tokens per call / (k * c + v), c = draft step time / target step time and
    v = the time of a target call over k + 1 positions in target steps (they assume v = 1; lesson 08
    measures it well above 1 on a CPU)."""
    return expected_tokens_per_call(alpha, k) / (k * cost_ratio + verify_cost)


def break_even_alpha(k: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """The acceptance alpha at which expected_speedup(alpha, k, c, v) = 1: a round must bring k * c + v tokens
    (by bisection: tokens per call grow with alpha). 1.0 where even alpha = 1 does not pay (k + 1 < k * c + v)."""
    need = k * cost_ratio + verify_cost
    if expected_tokens_per_call(1.0, k) < need:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens_per_call(mid, k) < need else (lo, mid)
    return hi


def best_k(alpha: float, cost_ratio: float, max_k: int = MAX_SPECULATIVE_TOKENS, verify_cost: float = 1.0) -> int:
    """The number of guesses (1..max_k) with the highest expected_speedup: more guesses pay only while
    alpha^k is not negligible next to the cost k * c of drafting them."""
    return max(range(1, max_k + 1), key=lambda k: expected_speedup(alpha, k, cost_ratio, verify_cost))


def roofline_speedup(alpha: float, k: int, batch: int, ridge_tokens: float) -> float:
    """Throughput of speculating k drafts per request over plain decoding, at `batch` requests, when a
    step over N tokens takes t(N) = max(1, N / ridge_tokens) (flat while reading the weights is the
    cost, linear once arithmetic is; drafting free): E(alpha, k) tokens per request-step for the price
    of t(batch (1 + k)) instead of t(batch)."""
    def t(n):
        return max(1.0, n / ridge_tokens)
    return expected_tokens_per_call(alpha, k) * t(batch) / t(batch * (1 + k))


def crossover_batch(alpha: float, k: int, ridge_tokens: float) -> float:
    """The batch size where roofline_speedup falls to 1: ridge_tokens * E(alpha, k) / (1 + k).
    Below it the drafts ride in the step's spare arithmetic; above it each rejected draft is paid. No KV
    bytes in it: roofline.speculative_crossover_batch adds them (at real contexts the crossover moves out)."""
    return ridge_tokens * expected_tokens_per_call(alpha, k) / (1 + k)


# Lesson 11: the pipeline's bubble
def bubble_fraction(p: int, m: int) -> float:
    """GPipe's idle share of the wall time for p equal stages and m micro-batches."""
    return (p - 1) / (m + p - 1)


# Lesson 05: HBM traffic of attention, naive against flash
FLASH_BLOCK_M_CUDA = 128   # the Triton kernel's default query tile on CUDA (kernels/flash_attention.py)


def hbm_bytes(n: int, head_dim: int, causal: bool, dtype_bytes: int = 2, block_m: int = FLASH_BLOCK_M_CUDA) -> dict:
    """Bytes moved between HBM and the chip for one (batch, head) of attention, N queries = N keys.

    naive (the article's three kernels):  S = QK^T reads Q, K and writes S; softmax reads S and
    writes P; O = PV reads P, V and writes O: 4*N*D + 4*N^2 elements.
    flash: Q read once, O written once, the fp32 LSE written once; every query tile reads the
    K and V tiles it needs (all N keys, or up to its diagonal when causal) exactly once.
    """
    nd = n * head_dim
    naive = (4 * nd + 4 * n * n) * dtype_bytes
    tiles = math.ceil(n / block_m)
    keys_read = sum(min(n, (i + 1) * block_m) for i in range(tiles)) if causal else tiles * n
    flash = (2 * nd + 2 * keys_read * head_dim) * dtype_bytes + 4 * n
    return {"naive_bytes": naive, "flash_bytes": flash, "score_matrix_bytes": n * n * dtype_bytes}


# Lesson 13: DeepSeek's ideas
def parameters_of(name: str, active: bool = False) -> float:
    """ModelConfig.num_parameters of a published shape by name (all weights, or one token's active ones)."""
    return ModelConfig.named(name).num_parameters(active)


def mla_cache_values_per_token(name: str) -> int:
    """Values one token caches per layer with MLA: the latent and the RoPE key (576 for DeepSeek-V3)."""
    return ModelConfig.named(name).mla.cache_width


def mha_cache_values_per_token(name: str, n_kv_heads: int | None = None) -> int:
    """What the same MLA model would cache per token and layer with ordinary K and V: each of n_kv_heads
    (default: every head, MHA) keeps a d_nope + d_rope key and a d_v value."""
    cfg = ModelConfig.named(name)
    return (n_kv_heads or cfg.n_heads) * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)


def experts_touched(batch: int, n_experts: int, top_k: int) -> float:
    """Expected distinct experts a decode step of `batch` tokens runs in one MoE layer, each token choosing
    top_k of n_experts uniformly: n (1 - (1 - k/n)^batch). A step reads every chosen expert's weights once."""
    return n_experts * (1 - (1 - top_k / n_experts) ** batch)


def moe_step_weight_bytes(name: str, batch: int, bytes_per_param: float) -> float:
    """Weights one decode step of `batch` tokens reads, routing even: every dense weight, plus in each MoE
    layer the experts_touched(batch) routed experts (the embedding rows are lookups, not counted)."""
    cfg = ModelConfig.named(name)
    moe = cfg.moe
    expert = 3 * cfg.dim * moe.expert_ffn_dim
    n_moe = sum(moe.is_moe_layer(i) for i in range(cfg.n_layers))
    all_but_routed = cfg.num_parameters() - cfg.vocab_size * cfg.dim - n_moe * moe.n_experts * expert
    return (all_but_routed + n_moe * experts_touched(batch, moe.n_experts, moe.top_k) * expert) * bytes_per_param
