"""The lab registry: per lab, the files and functions a student writes, the tasks that grade
them (each one or more pytest node ids; '*' matches any text; a node id without parameters covers
all of them), the time a class needs and the numbers a correct solution reaches.

Handouts: lessons/labs/NN-<lab>.md; teacher's guide: lessons/labs/README.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]          # the repository this minillm was imported from


class LabError(ValueError):
    """A bad lab name, bad markers, or a copy that cannot be made (the CLI prints it)."""


@dataclass(frozen=True)
class Task:
    name: str
    title: str
    tests: tuple[str, ...]          # node ids relative to the repository root; '*' is a wildcard


@dataclass(frozen=True)
class Lab:
    name: str
    number: int
    title: str
    minutes: int                    # time estimate for a class, reading the handout included
    files: tuple[str, ...]          # files that hold the solution regions
    functions: tuple[str, ...]      # what the student writes ("file: function")
    tasks: tuple[Task, ...]
    targets: tuple[str, ...]        # numbers a correct solution reaches
    quick_task: str = ""            # the task a quick self-check runs (default: the first)

    @property
    def handout(self) -> str:
        return f"lessons/labs/{self.number:02d}-{self.name}.md"

    def task(self, name: str) -> Task:
        for t in self.tasks:
            if t.name == name:
                return t
        raise LabError(f"lab {self.name} has no task {name!r}; tasks: {', '.join(t.name for t in self.tasks)}")


def _t(name: str, title: str, *tests: str) -> Task:
    return Task(name, title, tuple(tests))


KV = "tests/stages/test_kv_cache.py::"
GQA = "tests/attention/test_gqa.py::"
CONV = "tests/attention/test_gqa_convert.py::"
QF = "tests/quant/test_quant_formats.py::"
GPTQ = "tests/quant/test_quant_gptq.py::"
FA = "tests/attention/test_flash_attention.py::"
PG = "tests/kvcache/test_paged.py::"
PC = "tests/kvcache/test_prefix_cache.py::"
SCH = "tests/engine/test_scheduler.py::"
SPEC = "tests/speculative/test_speculative.py::"
TP = "tests/parallel/test_parallel.py::"
GUIDED = "tests/guided/test_guided.py::"

LABS: dict[str, Lab] = {lab.name: lab for lab in [
    Lab("kv_cache", 1, "KV cache: store K and V once, read them every step", 60,
        ("minillm/stages/kv_cache.py",),
        ("minillm/stages/kv_cache.py: KVCache.write", "minillm/stages/kv_cache.py: forward_cached (positions and mask, cache write/read, lengths)"),
        (_t("write", "KVCache.write puts each token's K and V at its own position",
            "tests/course/labs/test_lab_kv_cache.py::test_write_puts_each_token_at_its_position",
            "tests/course/labs/test_lab_kv_cache.py::test_write_overwrites_and_touches_nothing_else"),
         _t("logits", "prefill + decode logits equal the no-cache forward at every position",
            KV + "test_cached_logits_equal_full_forward"),
         _t("greedy", "128 greedy tokens identical to the naive baseline",
            KV + "test_tiny_128_tokens_identical_to_naive"),
         _t("batch", "a batch of prompts of different lengths equals one prompt at a time",
            KV + "test_tiny_batch_of_different_lengths_equals_one_at_a_time"),
         _t("rollback", "speculative decoding's rollback leaves a cache equal to a fresh one",
            SPEC + "test_draft_rollback_leaves_a_cache_equal_to_a_fresh_one")),
        ("cached logits within 1e-5 of the full forward (fp32, tiny model; the reference reaches 2.6e-6)",
         "greedy token ids identical to the naive baseline: 128 of 128",
         "on SmolLM2 (extra, slow): 128 greedy tokens identical; a cached decode step is ~6.5x faster than "
         "recomputing at 2048 tokens (results/kv-cache.json)")),
    Lab("gqa", 2, "Grouped-query attention without copying K/V, and MHA -> MQA conversion", 45,
        ("minillm/attention/gqa.py",),
        ("minillm/attention/gqa.py: grouped_attention", "minillm/attention/gqa.py: mean_pool_kv_heads"),
        (_t("equal", "grouped attention equals the repeat_interleave baseline (MHA, GQA, MQA; 12 cases)",
            GQA + "test_grouped_equals_repeat_interleave"),
         _t("nocopy", "no tensor the size of the repeated K or V is ever materialised",
            "tests/course/labs/test_lab_gqa.py::test_grouped_attention_copies_no_kv_head"),
         _t("cached", "the KV-cached model, which attends through grouped_attention, decodes like the baseline",
            KV + "test_tiny_128_tokens_identical_to_naive", KV + "test_tiny_batch_of_different_lengths_equals_one_at_a_time"),
         _t("meanpool", "mean-pooling K/V heads groups consecutive heads; same head count changes nothing",
            CONV + "test_mean_pool_groups_consecutive_heads", CONV + "test_converting_to_the_same_heads_changes_nothing"),
         _t("mqa", "a model converted to MQA (1 KV head) runs cached, equal to its own baseline",
            CONV + "test_mqa_model_runs_cached_equal_to_its_own_baseline")),
        ("max |grouped - baseline| <= 1e-5 on every case (the reference reaches 3.3e-7)",
         "largest tensor created: no bigger than q, K or the score matrix (the baseline makes Hq/Hkv copies of K and V)",
         "SmolLM2 converted to MQA without uptraining: perplexity 18.8 -> ~18800 at 2048 tokens "
         "(results/gqa.json): why GQA checkpoints are uptrained")),
    Lab("nf4_rtn", 3, "4-bit weights: bit packing, round-to-nearest groups, NF4", 90,
        ("minillm/quant/int4.py", "minillm/quant/nf4.py"),
        ("minillm/quant/int4.py: pack, unpack", "minillm/quant/int4.py: scale_zero, quantize_codes, dequantize",
         "minillm/quant/nf4.py: quantize_blockwise, dequantize_blockwise"),
        (_t("pack", "4-bit (high nibble first) and 3-bit (8 codes in 3 bytes) packing, bit-exact round trip",
            QF + "test_4bit_layout_first_element_in_high_nibble",
            QF + "test_3bit_layout_eight_codes_in_three_bytes_little_end_first",
            QF + "test_pack_unpack_roundtrip_is_bit_exact"),
         _t("rtn", "RTN error at most half a step; the asymmetric grid keeps 0 exact and beats symmetric",
            QF + "test_rtn_error_is_at_most_half_a_step",
            QF + "test_rtn_asymmetric_keeps_zero_exact_and_beats_symmetric_on_skewed_weights"),
         _t("nf4", "NF4 codes, absmax and dequantisation bit-identical to bitsandbytes; error within its bounds",
            QF + "test_nf4_quantize_and_dequantize_bit_identical_to_bitsandbytes",
            QF + "test_nf4_error_within_bitsandbytes_bounds_and_below_int4_absmax"),
         _t("double", "double quantisation of the absmax values (8-bit dynamic code) matches bitsandbytes; ~4.127 bits/weight",
            QF + "test_nf4_double_quant_against_bitsandbytes",
            QF + "test_nf4_bits_per_parameter_with_and_without_double_quant"),
         _t("model", "quantised linear layers compute x @ dequant(W); a whole model quantises and round-trips to disk",
            QF + "test_quant_linear_computes_x_times_dequantised_weight",
            QF + "test_quantize_model_equals_the_dequantised_float_model_and_save_load_roundtrip")),
        ("NF4 on N(0, 1) weights, block 64: mean |error| 0.0728 (bitsandbytes' bound 0.0733), mean relative error 0.204 "
         "(bound 0.2057); int4 absmax on the same blocks: 0.0914",
         "RTN: every error <= half a step (plus the fp16 rounding of the scale)",
         "SmolLM2 perplexity on Python's docs: fp32 16.10, int4 RTN g128 22.49, NF4 20.94 (results/quant.json)")),
    Lab("gptq", 4, "GPTQ: quantise column by column and let the rest compensate", 90,
        ("minillm/quant/gptq.py",),
        ("minillm/quant/gptq.py: HessianAccumulator.add, HessianAccumulator.hessian",
         "minillm/quant/gptq.py: inverse_hessian_factor", "minillm/quant/gptq.py: gptq_quantize (the column loop)"),
        (_t("hessian", "H = 2/n * sum x x^T, accumulated batch by batch",
            "tests/course/labs/test_lab_gptq.py::test_hessian_is_2_xtx_over_n"),
         _t("factor", "the upper Cholesky factor of the damped inverse Hessian",
            "tests/course/labs/test_lab_gptq.py::test_inverse_hessian_factor"),
         _t("loop", "lazy block updates give the same codes as one column at a time; dead inputs get zero weight",
            GPTQ + "test_blocksize_1_and_128_give_the_same_codes", GPTQ + "test_dead_inputs_get_zero_weight"),
         _t("objective", "GPTQ beats RTN on the layer objective ||W X - Q X||^2 (3 and 4 bits)",
            GPTQ + "test_gptq_beats_rtn_on_the_layer_objective"),
         _t("model", "GPTQ on a whole tiny model beats RTN on held-out tokens and saves/loads",
            GPTQ + "test_quantize_model_gptq_tiny_end_to_end")),
        ("layer objective ||W X - Q X||^2, GPTQ / RTN (g32, act-order): 0.40 at 4 bits, 0.41 at 3 bits (the test asks < 0.9)",
         "SmolLM2 perplexity: GPTQ 4-bit g128 19.04 vs RTN 22.49; 3-bit 40.4 vs 96.7 (results/quant.json)")),
    Lab("online_softmax", 5, "FlashAttention in PyTorch: the tiled online softmax with its log-sum-exp", 60,
        ("minillm/attention/flash.py",),
        ("minillm/attention/flash.py: flash_attention_torch (the loop over query and key tiles)",),
        (_t("fp32", "fp32 output and LSE within 1e-5 of naive attention (8 shapes: GQA, offsets, odd head dims; causal or not)",
            FA + "test_torch_tiled_fp32"),
         _t("lowp", "fp16 / bf16 within twice naive attention's own rounding error, any tile size",
            FA + "test_torch_tiled_low_precision_and_tile_sizes"),
         _t("memory", "no (Tq, Tk) score matrix is ever created",
            FA + "test_torch_tiled_never_builds_the_score_matrix"),
         _t("backward", "the tiled backward, recomputing P from your LSE, matches autograd",
            FA + "test_backward_torch_direct_matches_autograd",
            FA + "test_gradients_match_autograd_through_naive[*-torch]")),
        ("max |o - naive| in fp32 over the 8 test shapes: 8.3e-7, LSE 4.8e-7 (bound 1e-5)",
         "largest tensor created for N = 256, D = 32, 32x32 tiles: no bigger than q (naive builds N x N)",
         "peak memory at N = 8192 (1 head, D = 64): 4.2 MiB tiled vs 582 MiB naive, 138x less (results/flash-attention.json)")),
    Lab("flash_triton", 6, "FlashAttention in Triton: the kernel's inner loop", 90,
        ("kernels/flash_attention.py",),
        ("kernels/flash_attention.py: _attn_fwd_tiles (online softmax over one key tile)",
         "kernels/flash_attention.py: _attn_fwd (normalise and store O and the LSE)"),
        (_t("fp32", "fp32 kernel within 1e-5 of naive attention on 8 shapes, causal and not",
            FA + "test_triton_fp32"),
         _t("lowp", "fp16 / bf16 kernel within twice naive attention's own rounding error",
            FA + "test_triton_low_precision"),
         _t("tiles", "1025 tokens, other tile sizes and scales, strided inputs",
            FA + "test_triton_long_sequence_1025", FA + "test_triton_tile_sizes_and_scale",
            FA + "test_triton_reads_strided_inputs"),
         _t("backward", "gradients through the kernel's LSE match autograd",
            FA + "test_gradients_match_autograd_through_naive[*-triton]")),
        ("max |o - naive| in fp32 over the 8 test shapes: 8.3e-7, LSE 9.5e-7 (bound 1e-5), CPU under TRITON_INTERPRET=1",
         "the same tests pass on a CUDA GPU, where the kernel is compiled"),
        quick_task="tiles"),
    Lab("paged_blocks", 7, "Paged KV blocks and prefix caching", 75,
        ("minillm/kvcache/block_manager.py", "minillm/kvcache/prefix_cache.py"),
        ("minillm/kvcache/block_manager.py: BlockPool.allocate, BlockPool.acquire, BlockPool.release",
         "minillm/kvcache/prefix_cache.py: hash_block, chain_hashes, PrefixCache.match, PrefixCache.evict"),
        (_t("pool", "the pool hands out free blocks, counts holders and refuses double frees",
            "tests/course/labs/test_lab_paged.py::test_block_pool_counts_holders_and_recycles_blocks",
            PG + "test_blocks_are_allocated_as_the_sequence_grows", PG + "test_out_of_blocks_leaves_state_unchanged"),
         _t("fork", "forked sequences share blocks; the writer gets a copy (copy-on-write)",
            PG + "test_fork_shares_blocks_and_copies_on_write", PG + "test_parallel_sampling_keeps_each_branch_kv_right"),
         _t("hash", "chained block hashes: the same prefix has the same name in every process",
            PC + "test_hash_chains_the_parent", "tests/course/labs/test_lab_paged.py::test_hash_is_the_same_in_every_process"),
         _t("match", "a prefix hit confirms the tokens, stops at the first miss and leaves one token to compute",
            PC + "test_a_hit_confirms_the_tokens_not_only_the_hash", PC + "test_shared_system_prompt_is_computed_once",
            PC + "test_different_prefix_same_block_does_not_hit", PC + "test_full_prefix_hit_still_computes_one_token"),
         _t("evict", "freed cached blocks stay findable and are evicted least recently used first",
            PC + "test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first",
            PC + "test_prefix_hit_after_blocks_were_freed_and_reallocated",
            PC + "test_can_allocate_counts_evictable_hits_as_used",
            "tests/course/labs/test_lab_paged.py::test_pool_evicts_only_when_no_free_block_is_left"),
         _t("random", "random allocate / append / fork / free / evict sequences keep every invariant (hypothesis)",
            PG + "TestBlockManagerProperties", PG + "TestCachingBlockManagerProperties")),
        ("2000-request trace: 98.5% of the KV memory holds real tokens with paging vs 24.6% with a max-length "
         "reservation, 4.1x the concurrency (results/paged.json)",
         "16 requests sharing a 1K-token system prompt: 95.8% of prefill tokens reused (results/paged.json)")),
    Lab("scheduler", 8, "Continuous batching: one step of the scheduler", 90,
        ("minillm/engine/scheduler.py",),
        ("minillm/engine/scheduler.py: Scheduler.schedule", "minillm/engine/scheduler.py: Scheduler._preempt"),
        (_t("budget", "decodes and prefill chunks share the token budget; without chunking a prompt waits until it fits",
            SCH + "test_token_budget_is_shared_by_decodes_and_prefill_chunks",
            SCH + "test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole"),
         _t("join", "at most max_num_seqs run; a waiting request joins the step after one leaves; nothing leaks",
            SCH + "test_max_num_seqs_and_join_as_soon_as_a_request_leaves",
            SCH + "test_every_request_completes_and_no_block_leaks",
            SCH + "test_finish_frees_blocks_of_running_and_removes_waiting"),
         _t("preempt", "out of blocks: the newest running request is preempted and resumes first",
            SCH + "test_preemption_frees_the_newest_and_it_resumes_first"),
         _t("prefix", "prefix-cache hits skip cached tokens, also after a preemption",
            SCH + "test_prefix_hit_skips_cached_tokens_and_a_full_hit_leaves_one_token",
            SCH + "test_preemption_then_prefix_hit_resumes_from_its_own_cached_blocks")),
        ("budget 128, three 100-token prompts: step 1 runs (0: 100, 1: 28), step 2 runs (0: 1, 1: 72, 2: 55)",
         "every request finishes with exactly max_tokens tokens and every block returns to the pool")),
    Lab("rejection_sampler", 9, "Speculative decoding: the rule that keeps the target's distribution", 60,
        ("minillm/speculative/core.py",),
        ("minillm/speculative/core.py: greedy_verify", "minillm/speculative/core.py: rejection_sample"),
        (_t("greedy", "greedy verification keeps the matching prefix, then the target's own choice",
            SPEC + "test_greedy_verify_keeps_the_matching_prefix_then_the_target_choice"),
         _t("exact", "hand-built cases: accept, accept, reject -> residual; all accepted -> bonus token",
            SPEC + "test_forced_accept_accept_reject_gives_exact_tokens",
            SPEC + "test_all_accepted_adds_the_bonus_token_from_the_last_target_distribution"),
         _t("distribution", "every emitted position is distributed as the target (chi-square, 100k rounds; vLLM's convergence test)",
            SPEC + "test_every_emitted_position_is_distributed_as_the_target",
            SPEC + "test_vllm_convergence_distance_to_target_shrinks_20x_faster_than_to_references"),
         _t("rate", "acceptance rate = sum min(p, q); tokens per call = (1 - a^(k+1)) / (1 - a)",
            SPEC + "test_acceptance_rate_and_tokens_per_call_match_theory"),
         _t("runner", "the speculative runner on a tiny model: greedy token-identical for k = 1..8 (n-gram draft), seeded sampling reproducible",
            SPEC + "test_tiny_greedy_is_token_identical_to_plain_for_k_1_to_8[ngram]",
            SPEC + "test_tiny_seeded_sampling_reproduces_and_respects_max_tokens",
            SPEC + "test_verify_samples_the_filtered_distribution")),
        ("'random' pair, k = 4, 100k rounds: alpha = sum min(p, q) = 0.398, measured 0.397; tokens per call 1.644 "
         "in theory, 1.642 measured (the test allows 3 standard errors)",
         "chi-square p-values 0.23, 0.94, 0.70, 0.85 at positions 0-3 ('random' pair, k = 3; the test asks > 0.01; "
         "a sampler that skips the residual gets < 1e-6)",
         "SmolLM2, greedy, n-gram draft on a grounded prompt: 2.8x faster at k = 6 (results/speculative.json)")),
    Lab("row_parallel", 10, "Tensor parallelism: the row-parallel linear and its all-reduce", 45,
        ("minillm/parallel/tensor.py",),
        ("minillm/parallel/tensor.py: row_parallel",),
        (_t("row", "a row-parallel linear over 3 gloo ranks equals the unsplit one, one all-reduce, the bias added once",
            TP + "test_row_parallel_linear_equals_the_unsplit_layer_with_one_all_reduce"),
         _t("block", "attention and SwiGLU with heads and FFN split equal the unsplit block; the plain forward too",
            TP + "test_block_with_heads_split_equals_the_unsplit_block",
            TP + "test_plain_forward_logits_and_greedy_tokens_equal_one_process"),
         _t("cached", "the KV-cached path on 3 shards, each caching its own KV head, equals one process",
            TP + "test_kv_cached_path_equals_one_process_and_caches_only_own_kv_heads"),
         _t("bytes", "the bytes all-reduced per token are 2 per layer (+ the embedding's) of dim values",
            TP + "test_tp_bytes_counted_match_two_all_reduces_per_layer_per_token"),
         _t("engine", "LLM(..., tensor_parallel_size=3): the batching engine over 3 processes gives one process's tokens",
            "tests/parallel/test_parallel_llm.py::TestTensorParallelEngine::test_engine_with_tensor_parallel_3_equals_one_process")),
        ("logits within 1e-5 of the unsplit model in fp32 (tiny model, 3 ranks; the reference reaches ~2e-6)",
         "2 x 3 + 1 = 7 all-reduces of (tokens, dim) per forward of the 3-layer tiny model",
         "SmolLM2 at tensor_parallel_size 3: greedy tokens identical, logprobs within 1e-5 (tests/parallel/test_parallel_llm.py)")),
    Lab("token_mask", 11, "Structured outputs: the token-level mask from a byte DFA", 45,
        ("minillm/guided/token_automaton.py",),
        ("minillm/guided/token_automaton.py: allowed_tokens",),
        (_t("walk", "in every DFA state, the allowed tokens equal a token-by-token walk (tokens that split a UTF-8 character included)",
            GUIDED + "test_token_mask_equals_a_brute_force_walk"),
         _t("eos", "EOS only where the output may end; a state's mask is computed once and cached",
            GUIDED + "test_eos_only_in_accepting_states", GUIDED + "test_compiled_guides_are_cached_per_tokenizer"),
         _t("generate", "guided generation on the tiny model: every output matches its regex or choice, on every path",
            GUIDED + "test_guided_outputs_match_on_every_path", GUIDED + "test_guided_greedy_is_the_argmax_of_the_masked_logits",
            GUIDED + "test_cut_by_max_tokens_is_a_valid_prefix"),
         _t("peer", "SmolLM2's vocabulary: the same allowed tokens as outlines-core in every visited state",
            "tests/guided/test_guided_peer.py::test_allowed_tokens_equal_outlines_core_in_every_visited_state")),
        ("the mask equals the brute-force walk in every state of the test DFA, for 4 random vocabularies",
         "SmolLM2: equal to outlines-core's Index on 5 prefix-free regexes and schemas (tests/guided/test_guided_peer.py)",
         "a cached mask costs a lookup and a masked_fill per step (results/structured.json, warm_mask_ms)")),
]}


def get_lab(name: str) -> Lab:
    if name not in LABS:
        raise LabError(f"unknown lab {name!r}; labs: {', '.join(LABS)}")
    return LABS[name]
