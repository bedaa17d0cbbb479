"""Classroom labs: hand students the library with one technique cut out, then grade what they write.

The reference implementation marks what a student writes with comment lines, indented like the
code they wrap and always inside a function body: a line `# BEGIN SOLUTION <lab>` (any text after
the lab name is a hint), optional `# HINT: ...` lines right after it, the reference code, and a
line `# END SOLUTION`.

`python -m minillm lab make kv_cache --out DIR` writes a student copy of the repository in which
the kv_cache regions are replaced by a stub that raises NotImplementedError (the hint stays, as
comments), so the signature and docstring survive and everything else still imports and runs;
the markers of the other labs are removed and their code kept.

`python -m minillm lab grade kv_cache --repo DIR [DIR ...]` runs the lab's tests against each
copy and scores it task by task. The tests come from the repository this module belongs to
(the teacher's reference), not from the copy, so editing the copy's tests earns nothing. Each
copy is graded in its own pytest process with the copy first on sys.path: a crash, a hang (after
--timeout seconds), an import error or NotImplementedError fails tasks, never the grader.

The registry (LABS) says, per lab: the files and functions to write, the tasks (each one or more
pytest node ids, '*' matches any text; a node id without parameters covers all of them), the time
a class needs, and the numbers a correct solution reaches. Handouts: lessons/labs/NN-<lab>.md;
teacher's guide: lessons/labs/README.md. This module only needs the standard library (pytest
runs in the grading process), so `python -m minillm lab list` is instant.
"""
from __future__ import annotations

import ast
import contextlib
import csv
import functools
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import types
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]          # the repository this minillm was imported from
DEFAULT_TIMEOUT = 900                                # seconds per graded copy
# files of the reference that a student copy does not need
EXCLUDE_SUFFIXES = (".png", ".jpg", ".jpeg", ".gif", ".svg", ".pdf")
EXCLUDE_DIRS = ("results/",)                         # only the images under these are left out


class LabError(ValueError):
    """A bad lab name, bad markers, or a copy that cannot be made (the CLI prints it)."""


# ============================================================================ the registry

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


KV = "tests/test_kv_cache.py::"
GQA = "tests/test_gqa.py::"
CONV = "tests/test_gqa_convert.py::"
QF = "tests/test_quant_formats.py::"
GPTQ = "tests/test_quant_gptq.py::"
FA = "tests/test_flash_attention.py::"
PG = "tests/test_paged.py::"
PC = "tests/test_prefix_cache.py::"
SCH = "tests/test_scheduler.py::"
SPEC = "tests/test_speculative.py::"

LABS: dict[str, Lab] = {lab.name: lab for lab in [
    Lab("kv_cache", 1, "KV cache: store K and V once, read them every step", 60,
        ("minillm/kv_cache.py",),
        ("minillm/kv_cache.py: KVCache.write", "minillm/kv_cache.py: forward_cached (positions and mask, cache write/read, lengths)"),
        (_t("write", "KVCache.write puts each token's K and V at its own position",
            "tests/labs/test_lab_kv_cache.py::test_write_puts_each_token_at_its_position",
            "tests/labs/test_lab_kv_cache.py::test_write_overwrites_and_touches_nothing_else"),
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
        ("minillm/gqa.py",),
        ("minillm/gqa.py: grouped_attention", "minillm/gqa.py: mean_pool_kv_heads"),
        (_t("equal", "grouped attention equals the repeat_interleave baseline (MHA, GQA, MQA; 12 cases)",
            GQA + "test_grouped_equals_repeat_interleave"),
         _t("nocopy", "no tensor the size of the repeated K or V is ever materialised",
            "tests/labs/test_lab_gqa.py::test_grouped_attention_copies_no_kv_head"),
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
            QF + "test_quantize_model_replaces_linears_and_save_load_roundtrip")),
        ("NF4 on N(0, 1) weights, block 64: mean |error| 0.0728 (bitsandbytes' bound 0.0733), mean relative error 0.204 "
         "(bound 0.2057); int4 absmax on the same blocks: 0.0914",
         "RTN: every error <= half a step (plus the fp16 rounding of the scale)",
         "SmolLM2 perplexity on Python's docs: fp32 16.10, int4 RTN g128 22.49, NF4 20.94 (results/quant.json)")),
    Lab("gptq", 4, "GPTQ: quantise column by column and let the rest compensate", 90,
        ("minillm/quant/gptq.py",),
        ("minillm/quant/gptq.py: HessianAccumulator.add, HessianAccumulator.hessian",
         "minillm/quant/gptq.py: inverse_hessian_factor", "minillm/quant/gptq.py: gptq_quantize (the column loop)"),
        (_t("hessian", "H = 2/n * sum x x^T, accumulated batch by batch",
            "tests/labs/test_lab_gptq.py::test_hessian_is_2_xtx_over_n"),
         _t("factor", "the upper Cholesky factor of the damped inverse Hessian",
            "tests/labs/test_lab_gptq.py::test_inverse_hessian_factor"),
         _t("loop", "lazy block updates give the same codes as one column at a time; dead inputs get zero weight",
            GPTQ + "test_blocksize_1_and_128_give_the_same_codes", GPTQ + "test_dead_inputs_get_zero_weight"),
         _t("objective", "GPTQ beats RTN on the layer objective ||W X - Q X||^2 (3 and 4 bits)",
            GPTQ + "test_gptq_beats_rtn_on_the_layer_objective"),
         _t("model", "GPTQ on a whole tiny model beats RTN on held-out tokens and saves/loads",
            GPTQ + "test_quantize_model_gptq_tiny_end_to_end")),
        ("layer objective ||W X - Q X||^2, GPTQ / RTN (g32, act-order): 0.40 at 4 bits, 0.41 at 3 bits (the test asks < 0.9)",
         "SmolLM2 perplexity: GPTQ 4-bit g128 19.04 vs RTN 22.49; 3-bit 40.4 vs 96.7 (results/quant.json)")),
    Lab("online_softmax", 5, "FlashAttention in PyTorch: the tiled online softmax with its log-sum-exp", 60,
        ("minillm/flash_attention.py",),
        ("minillm/flash_attention.py: flash_attention_torch (the loop over query and key tiles)",),
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
        ("minillm/paged.py", "minillm/prefix_cache.py"),
        ("minillm/paged.py: BlockPool.allocate, BlockPool.acquire, BlockPool.release",
         "minillm/prefix_cache.py: hash_block, chain_hashes, PrefixCache.match, PrefixCache.evict"),
        (_t("pool", "the pool hands out free blocks, counts holders and refuses double frees",
            "tests/labs/test_lab_paged.py::test_block_pool_counts_holders_and_recycles_blocks",
            PG + "test_blocks_are_allocated_as_the_sequence_grows", PG + "test_out_of_blocks_leaves_state_unchanged"),
         _t("fork", "forked sequences share blocks; the writer gets a copy (copy-on-write)",
            PG + "test_fork_shares_blocks_and_copies_on_write", PG + "test_parallel_sampling_keeps_each_branch_kv_right"),
         _t("hash", "chained block hashes: the same prefix has the same name in every process",
            PC + "test_hash_chains_the_parent", "tests/labs/test_lab_paged.py::test_hash_is_the_same_in_every_process"),
         _t("match", "a prefix hit confirms the tokens, stops at the first miss and leaves one token to compute",
            PC + "test_a_hit_confirms_the_tokens_not_only_the_hash", PC + "test_shared_system_prompt_is_computed_once",
            PC + "test_different_prefix_same_block_does_not_hit", PC + "test_full_prefix_hit_still_computes_one_token"),
         _t("evict", "freed cached blocks stay findable and are evicted least recently used first",
            PC + "test_freed_blocks_stay_cached_and_are_evicted_lru_tail_first",
            PC + "test_prefix_hit_after_blocks_were_freed_and_reallocated",
            PC + "test_can_allocate_counts_evictable_hits_as_used",
            "tests/labs/test_lab_paged.py::test_pool_evicts_only_when_no_free_block_is_left"),
         _t("random", "random allocate / append / fork / free / evict sequences keep every invariant (hypothesis)",
            PG + "TestBlockManagerProperties", PG + "TestCachingBlockManagerProperties")),
        ("2000-request trace: 98.5% of the KV memory holds real tokens with paging vs 24.6% with a max-length "
         "reservation, 4.1x the concurrency (results/paged.json)",
         "16 requests sharing a 1K-token system prompt: 95.8% of prefill tokens reused (results/paged.json)")),
    Lab("scheduler", 8, "Continuous batching: one step of the scheduler", 90,
        ("minillm/scheduler.py",),
        ("minillm/scheduler.py: Scheduler.schedule", "minillm/scheduler.py: Scheduler._preempt"),
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
        ("minillm/speculative.py",),
        ("minillm/speculative.py: greedy_verify", "minillm/speculative.py: rejection_sample"),
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
]}


def get_lab(name: str) -> Lab:
    if name not in LABS:
        raise LabError(f"unknown lab {name!r}; labs: {', '.join(LABS)}")
    return LABS[name]


# ============================================================================ solution regions

BEGIN_RE = re.compile(r"^(?P<indent>[ \t]*)# BEGIN SOLUTION[ \t]+(?P<lab>\w+)(?P<rest>.*)$")
END_RE = re.compile(r"^(?P<indent>[ \t]*)# END SOLUTION\b")
HINT_RE = re.compile(r"^[ \t]*# HINT:[ \t]?(?P<hint>.*)$")
MARKER_RE = re.compile(r"^[ \t]*#[ \t]*(BEGIN|END) SOLUTION\b")     # what must not survive in a copy


@dataclass(frozen=True)
class Region:
    path: str                       # relative to the repository root
    lab: str
    begin: int                      # 1-based line of "# BEGIN SOLUTION"
    end: int                        # 1-based line of "# END SOLUTION"
    hint_end: int                   # last line of the BEGIN + HINT header
    indent: str
    hint: str                       # its lines as written (joined by newlines)
    function: str                   # qualified name of the enclosing function

    def __str__(self) -> str:
        return f"{self.path}:{self.begin}-{self.end} {self.function}"


def _function_spans(tree: ast.AST) -> list[tuple[int, int, str]]:
    spans = []

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                spans.append((child.lineno, child.end_lineno, prefix + child.name))
                visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)
    visit(tree, "")
    return spans


def parse_regions(text: str, path: str = "<text>") -> list[Region]:
    """The solution regions of one Python source, validated: paired, not nested, inside a function,
    with code in them at the marker's indentation."""
    lines = text.splitlines()
    if not any(MARKER_RE.match(line) for line in lines):
        return []
    try:
        spans = _function_spans(ast.parse(text))
    except SyntaxError as e:
        raise LabError(f"{path}: cannot parse ({e})") from e
    regions, open_ = [], None
    for no, line in enumerate(lines, 1):
        begin, end = BEGIN_RE.match(line), END_RE.match(line)
        if begin:
            if open_:
                raise LabError(f"{path}:{no}: BEGIN SOLUTION inside the region opened at line {open_['begin']}")
            rest = begin["rest"].strip().lstrip(":-").strip()
            rest = rest[len("HINT:"):].strip() if rest.startswith("HINT:") else rest
            open_ = dict(begin=no, lab=begin["lab"], indent=begin["indent"], hints=[rest] if rest else [], hint_end=no)
            continue
        if open_ and open_["hint_end"] == no - 1 and HINT_RE.match(line):
            open_["hints"].append(HINT_RE.match(line)["hint"].strip())
            open_["hint_end"] = no
            continue
        if end:
            if not open_:
                raise LabError(f"{path}:{no}: END SOLUTION without a BEGIN")
            if end["indent"] != open_["indent"]:
                raise LabError(f"{path}:{no}: END SOLUTION is not indented like its BEGIN (line {open_['begin']})")
            body = [(i, lines[i - 1]) for i in range(open_["hint_end"] + 1, no)
                    if lines[i - 1].strip() and not lines[i - 1].strip().startswith("#")]
            if not body:
                raise LabError(f"{path}:{open_['begin']}: the region holds no code")
            first = body[0][1]
            if first[:len(first) - len(first.lstrip())] != open_["indent"]:
                raise LabError(f"{path}:{body[0][0]}: the region's code must start at the marker's indentation")
            last_code = body[-1][0]                          # a function's end_lineno is its last code line
            inside = [s for s in spans if s[0] < open_["begin"] and last_code <= s[1]]
            if not inside:
                raise LabError(f"{path}:{open_['begin']}: a solution region must sit inside a function body")
            function = max(inside, key=lambda s: s[0])[2]
            regions.append(Region(path, open_["lab"], open_["begin"], no, open_["hint_end"], open_["indent"],
                                  "\n".join(open_["hints"]), function))
            open_ = None
            continue
        if MARKER_RE.match(line):
            raise LabError(f"{path}:{no}: malformed marker {line.strip()!r}")
    if open_:
        raise LabError(f"{path}:{open_['begin']}: BEGIN SOLUTION without an END")
    return regions


def stub_lines(region: Region) -> list[str]:
    """What replaces a region in the student copy: the hint as comments, then a raise."""
    lab = LABS.get(region.lab)
    where = lab.handout if lab else "the handout"
    ind = region.indent
    out = [f"{ind}# TODO(lab {region.lab}): write this part of {region.function} ({where})."]
    width = max(60, 120 - len(ind))                # hint lines keep the author's breaks unless very long
    for i, hint in enumerate(region.hint.splitlines()):
        for j, line in enumerate(textwrap.wrap(hint, width=width) or [""]):
            out.append(f"{ind}# {'HINT: ' if i == j == 0 else '      '}{line}".rstrip())
    msg = f"lab {region.lab}: {region.function} in {region.path} is yours to write (see {where})"
    out.append(f"{ind}raise NotImplementedError({msg!r})")
    return out


def strip_solutions(text: str, path: str, lab: str) -> tuple[str, list[Region]]:
    """A source with `lab`'s regions replaced by stubs and every other lab's markers removed.
    Returns the new text and the regions that were stubbed."""
    regions = parse_regions(text, path)
    if not regions:
        return text, []
    lines = text.splitlines(keepends=True)
    newline = "\r\n" if lines and lines[0].endswith("\r\n") else "\n"
    out, stubbed, i = [], [], 0
    by_begin = {r.begin: r for r in regions}
    while i < len(lines):
        region = by_begin.get(i + 1)
        if region is None:
            out.append(lines[i])
            i += 1
            continue
        if region.lab == lab:
            out += [line + newline for line in stub_lines(region)]
            stubbed.append(region)
        else:
            out += lines[region.hint_end:region.end - 1]        # the code, without BEGIN, HINT and END
        i = region.end
    new = "".join(out)
    if stubbed:
        try:
            ast.parse(new)
        except SyntaxError as e:
            raise LabError(f"{path}: the stubbed source does not parse ({e}); check the regions") from e
    return new, stubbed


def repo_files(repo: Path = REPO) -> list[str]:
    """Files of a repository that a copy carries: what git tracks plus untracked files it does not
    ignore; without git, a walk that skips the usual build and cache folders."""
    repo = Path(repo)
    try:
        raw = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             capture_output=True, check=True, timeout=60).stdout
        names = sorted({n for n in raw.decode().split("\0") if n})
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".hypothesis", ".ipynb_checkpoints"}
        names = sorted(str(p.relative_to(repo)).replace(os.sep, "/") for p in repo.rglob("*")
                       if p.is_file() and not skip.intersection(p.relative_to(repo).parts)
                       and not p.name.endswith((".pyc", ".gguf")))
    return [n for n in names if (repo / n).is_file() and not (repo / n).is_symlink()]


def find_regions(repo: Path = REPO, lab: str | None = None) -> list[Region]:
    """Every solution region in the repository's Python files (optionally of one lab)."""
    regions = []
    for name in repo_files(repo):
        if name.endswith(".py"):
            regions += parse_regions((Path(repo) / name).read_text(encoding="utf-8"), name)
    unknown = sorted({r.lab for r in regions} - set(LABS))
    if unknown:
        raise LabError(f"solution regions name unknown labs: {', '.join(unknown)} ({[str(r) for r in regions if r.lab in unknown]})")
    return [r for r in regions if lab is None or r.lab == lab]


def leftover_markers(root: Path) -> list[str]:
    """'file:line' of every solution marker left under root (a student copy must have none)."""
    hits = []
    for p in sorted(Path(root).rglob("*")):
        if p.is_file() and p.suffix in (".py", ".md", ".txt", ".ipynb", ".cfg", ".toml", ".ini", ""):
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            for no, line in enumerate(text.splitlines(), 1):
                if MARKER_RE.match(line):
                    hits.append(f"{p.relative_to(root)}:{no}")
    return hits


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def make_student_copy(lab: str, out, repo: Path = REPO, force: bool = False, git: bool = False) -> dict:
    """Write a student copy of `repo` for `lab` into `out`; returns {"files", "stubbed", "out"}."""
    lab_obj = get_lab(lab)
    repo, out = Path(repo).resolve(), Path(out).resolve()
    if _inside(out, repo):
        raise LabError(f"--out {out} is inside the reference repository {repo}; choose a folder outside it")
    if _inside(repo, out):
        raise LabError(f"--out {out} contains the reference repository; choose another folder")
    if out.exists() and any(out.iterdir()):
        if not force:
            raise LabError(f"{out} exists and is not empty (pass --force to replace it)")
        shutil.rmtree(out)
    files = [n for n in repo_files(repo)
             if not (n.startswith(EXCLUDE_DIRS) and n.lower().endswith(EXCLUDE_SUFFIXES))]
    missing = [f for f in lab_obj.files if f not in files]
    if missing:
        raise LabError(f"lab {lab}: {', '.join(missing)} not found in {repo}")
    out.mkdir(parents=True, exist_ok=True)
    stubbed = []
    for name in files:
        src, dst = repo / name, out / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".py"):
            text, regions = strip_solutions(src.read_text(encoding="utf-8"), name, lab)
            dst.write_text(text, encoding="utf-8")
            shutil.copymode(src, dst)
            stubbed += regions
        else:
            shutil.copy2(src, dst)
    if not stubbed:
        raise LabError(f"lab {lab}: no '# BEGIN SOLUTION {lab}' region found in {repo}")
    left = leftover_markers(out)
    if left:
        raise LabError(f"solution markers survived in the copy: {', '.join(left[:5])}")
    if git:
        cmd = ["git", "-c", "user.name=minillm lab", "-c", "user.email=lab@minillm.invalid"]
        subprocess.run(["git", "init", "-q", str(out)], check=True)
        subprocess.run(cmd + ["-C", str(out), "add", "-A"], check=True)
        subprocess.run(cmd + ["-C", str(out), "commit", "-q", "-m", f"lab {lab}: student copy"], check=True)
    return {"out": out, "files": len(files), "stubbed": stubbed}


# ============================================================================ grading

# The pytest plugin of a grading run. It is source text, written next to the run (or executed
# in-process), so that it imports neither minillm nor anything of the copy being graded: it keeps
# only the selected tests and records every outcome as one JSON line, flushed at once, so a run
# that dies half-way still leaves what it did.
PLUGIN_SOURCE = r'''
import json, os, re, sys


def compile_selector(selector):
    body = ".*".join(re.escape(part) for part in selector.split("*"))
    return re.compile(body + r"(?:\[.*\]|::.*)?", re.S)


def message_of(report):
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        return crash.message[:600]
    if isinstance(report.longrepr, tuple) and len(report.longrepr) == 3:
        return str(report.longrepr[2])[:600]                   # a skip: (path, line, reason)
    return str(report.longrepr)[-600:]


class Recorder:
    def __init__(self, selectors, out_path=None):
        self.patterns = [compile_selector(s) for s in selectors]
        self.out_path = out_path
        self.records = []

    def emit(self, record):
        self.records.append(record)
        if self.out_path:
            with open(self.out_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def pytest_collection_modifyitems(self, session, config, items):
        keep = [i for i in items if any(p.fullmatch(i.nodeid) for p in self.patterns)]
        drop = [i for i in items if i not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
        items[:] = keep
        self.emit({"kind": "collected", "nodeids": [i.nodeid for i in keep]})

    def pytest_collectreport(self, report):
        if report.failed or report.skipped:
            self.emit({"kind": "collect", "nodeid": report.nodeid, "outcome": report.outcome,
                       "message": message_of(report)})

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            self.emit({"kind": "test", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                       "message": "" if report.outcome == "passed" else message_of(report)})

    def pytest_sessionfinish(self, session, exitstatus):
        origins = {name: getattr(sys.modules.get(name), "__file__", None) for name in ("minillm", "kernels")}
        self.emit({"kind": "finish", "exitstatus": int(exitstatus), "origins": origins})


def pytest_configure(config):
    path = os.environ.get("MINILLM_LAB_REPORT")
    if path and not config.pluginmanager.has_plugin("minillm_lab_recorder"):
        with open(path + ".json", encoding="utf-8") as f:
            selectors = json.load(f)
        config.pluginmanager.register(Recorder(selectors, path), "minillm_lab_recorder")
'''
PLUGIN_NAME = "_minillm_lab_report"


def _plugin_module() -> types.ModuleType:
    module = types.ModuleType(PLUGIN_NAME)
    exec(compile(PLUGIN_SOURCE, PLUGIN_NAME, "exec"), module.__dict__)
    return module


@functools.lru_cache(maxsize=None)
def _selector_pattern(selector: str) -> re.Pattern:
    return _plugin_module_cached().compile_selector(selector)


def _matches(selector: str, nodeid: str) -> bool:
    return _selector_pattern(selector).fullmatch(nodeid) is not None


_PLUGIN = None


def _plugin_module_cached() -> types.ModuleType:
    global _PLUGIN
    if _PLUGIN is None:
        _PLUGIN = _plugin_module()
    return _PLUGIN


@dataclass
class TaskResult:
    task: Task
    passed: bool
    n_passed: int = 0
    n_failed: int = 0
    n_skipped: int = 0
    message: str = ""               # the first failure (or why nothing ran)


@dataclass
class LabResult:
    lab: Lab
    repo: Path
    tasks: list[TaskResult] = field(default_factory=list)
    error: str = ""                 # about the run as a whole (crash, timeout, wrong import)
    seconds: float = 0.0

    @property
    def n_passed(self) -> int:
        return sum(t.passed for t in self.tasks)

    @property
    def n_tasks(self) -> int:
        return len(self.tasks)

    @property
    def percent(self) -> int:
        return round(100 * self.n_passed / self.n_tasks) if self.n_tasks else 0

    def summary_line(self) -> str:
        return f"{self.lab.name}: {self.n_passed}/{self.n_tasks} tasks, {self.percent}%"


def _run_pytest_subprocess(repo: Path, files: list[str], selectors: list[str], tests_root: Path,
                           timeout: float, python: str) -> tuple[list[dict], str]:
    """pytest in a fresh process, cwd = the copy, the copy first on sys.path. Returns (records, note)."""
    with tempfile.TemporaryDirectory(prefix="minillm-lab-") as tmp:
        tmp = Path(tmp)
        (tmp / f"{PLUGIN_NAME}.py").write_text(PLUGIN_SOURCE, encoding="utf-8")
        report = tmp / "report.jsonl"
        (tmp / "report.jsonl.json").write_text(json.dumps(selectors), encoding="utf-8")
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(repo), str(tmp)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        env["MINILLM_LAB_REPORT"] = str(report)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        cmd = [python, "-m", "pytest", "-p", PLUGIN_NAME, "-p", "no:cacheprovider", "-o", "addopts=",
               "-q", "--rootdir", str(tests_root), "-c", str(tests_root / "pytest.ini")]
        cmd += [str(tests_root / f) for f in files]
        log = tmp / "pytest.log"
        note = ""
        with open(log, "wb") as logf:
            proc = subprocess.Popen(cmd, cwd=repo, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill(proc)
                note = f"timed out after {timeout:.0f} s"
                code = None
        records = []
        if report.exists():
            for line in report.read_text(encoding="utf-8").splitlines():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    pass                                       # a line cut short by a crash
        if not any(r["kind"] == "finish" for r in records) and not note:
            tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-3:]
            note = f"pytest stopped early (exit code {code})" + (f": {' | '.join(tail)}" if tail else "")
        return records, note


def _kill(proc: subprocess.Popen) -> None:
    try:
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _run_pytest_in_process(files: list[str], selectors: list[str], tests_root: Path) -> tuple[list[dict], str]:
    """pytest.main in this process (a notebook's self-check): fast, but a crash is this process's."""
    import pytest

    recorder = _plugin_module_cached().Recorder(selectors)
    args = ["-p", "no:cacheprovider", "-p", "no:faulthandler", "-o", "addopts=", "-q", "--capture=sys",
            "--rootdir", str(tests_root),
            "-c", str(tests_root / "pytest.ini")] + [str(tests_root / f) for f in files]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        pytest.main(args, plugins=[recorder])
    return recorder.records, ""


def _score(lab: Lab, tasks: list[Task], records: list[dict]) -> list[TaskResult]:
    collected = [n for r in records if r["kind"] == "collected" for n in r["nodeids"]]
    phases: dict[str, list[tuple[str, str]]] = {}
    for r in records:
        if r["kind"] == "test":
            phases.setdefault(r["nodeid"], []).append((r["outcome"], r["message"]))

    def final(nodeid):                      # failed in any phase > skipped > passed; None: never reported
        seen = phases.get(nodeid, [])
        for wanted in ("failed", "skipped", "passed"):
            for outcome, msg in seen:
                if outcome == wanted:
                    return outcome, msg
        return None, "did not finish (crash or timeout)"

    collect_problems = [r for r in records if r["kind"] == "collect"]
    results = []
    for task in tasks:
        res, skip_reason = TaskResult(task, passed=False), ""
        for selector in task.tests:
            ids = [n for n in collected if _matches(selector, n)]
            if not ids:
                file = selector.split("::")[0]
                why = next((f"{p['outcome']} at collection: {p['message']}" for p in collect_problems
                            if p["nodeid"] == file or p["nodeid"].startswith(file + "::")), "no such test (did it run?)")
                res.n_failed += 1
                res.message = res.message or f"{selector}: {why}"
            for nodeid in ids:
                outcome, msg = final(nodeid)
                if outcome == "passed":
                    res.n_passed += 1
                elif outcome == "skipped":
                    res.n_skipped += 1
                    skip_reason = skip_reason or msg
                else:
                    res.n_failed += 1
                    res.message = res.message or f"{nodeid}: {msg}"
        res.passed = res.n_failed == 0 and res.n_passed > 0
        if not res.passed and not res.message:
            res.message = f"every test skipped: {skip_reason}"
        results.append(res)
    return results


def grade_labs(repo, labs: list[str], tasks: list[str] | None = None, isolated: bool = True,
               timeout: float = DEFAULT_TIMEOUT, tests_root: Path = REPO, python: str | None = None) -> list[LabResult]:
    """Grade one copy on one or more labs in ONE pytest run; never raises for what the copy does.

    isolated=True: a fresh process (the grader's choice); False: this process, which must have
    imported minillm from `repo` (a notebook's self-check)."""
    lab_objs = [get_lab(name) for name in labs]
    repo, tests_root = Path(repo).resolve(), Path(tests_root).resolve()
    chosen = {lab.name: ([lab.task(t) for t in tasks] if tasks else list(lab.tasks)) for lab in lab_objs}
    selectors = list(dict.fromkeys(s for ts in chosen.values() for t in ts for s in t.tests))
    files = list(dict.fromkeys(s.split("::")[0] for s in selectors))
    start = time.perf_counter()
    if not (repo / "minillm").is_dir():
        records, note = [], f"{repo} holds no minillm package"
    elif isolated:
        records, note = _run_pytest_subprocess(repo, files, selectors, tests_root, timeout, python or sys.executable)
    else:
        here = Path(sys.modules[__package__].__file__).resolve().parents[1]
        if here != repo:
            raise LabError(f"in-process grading needs minillm imported from {repo}, not {here}")
        records, note = _run_pytest_in_process(files, selectors, tests_root)
    finish = next((r for r in records if r["kind"] == "finish"), None)
    if finish:
        for name, origin in finish["origins"].items():
            if origin and not _inside(Path(origin).resolve(), repo):
                note = f"the tests imported {name} from {origin}, not from {repo}: nothing was graded"
                records = []
    seconds = time.perf_counter() - start
    return [LabResult(lab, repo, _score(lab, chosen[lab.name], records), note, seconds) for lab in lab_objs]


def grade(repo, lab: str, tasks: list[str] | None = None, **kwargs) -> LabResult:
    """Grade one copy on one lab (see grade_labs for the options)."""
    return grade_labs(repo, [lab], tasks, **kwargs)[0]


def grade_many(repos, lab: str, jobs: int = 1, **kwargs) -> list[LabResult]:
    """Grade several copies on one lab, each in its own process, `jobs` at a time; results in order."""
    repos = list(repos)
    if jobs <= 1:
        return [grade(r, lab, **kwargs) for r in repos]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(lambda r: grade(r, lab, **kwargs), repos))


def submissions_in(folder) -> list[Path]:
    """Every sub-folder of `folder` that holds a minillm package (one per student)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise LabError(f"{folder} is not a folder")
    return sorted(p for p in folder.iterdir() if (p / "minillm").is_dir())


# ============================================================================ reports

def format_result(result: LabResult, tests: bool = False) -> str:
    lab = result.lab
    lines = [f"lab {lab.name} ({lab.number:02d}, {lab.title}) -- {result.repo}"]
    width = max(len(t.task.name) for t in result.tasks) if result.tasks else 0
    for i, t in enumerate(result.tasks, 1):
        counts = f"{t.n_passed}/{t.n_passed + t.n_failed} tests" + (f", {t.n_skipped} skipped" if t.n_skipped else "")
        lines.append(f"  {'PASS' if t.passed else 'FAIL'}  {i}. {t.task.name:<{width}}  {t.task.title}  [{counts}]")
        if not t.passed and t.message:
            lines.append("        " + t.message.strip().splitlines()[0][:300])
        if tests:
            lines += [f"        {s}" for s in t.task.tests]
    if result.error:
        lines.append(f"  note: {result.error}")
    lines.append(result.summary_line())
    return "\n".join(lines)


def format_row(result: LabResult, name_width: int = 20) -> str:
    marks = " ".join(f"{t.task.name}{'+' if t.passed else '-'}" for t in result.tasks)
    row = f"{result.repo.name:<{name_width}} {result.summary_line():<34} {marks}"
    return row + (f"  ({result.error})" if result.error else "")


def write_csv(results: list[LabResult], path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [t.task.name for t in results[0].tasks] if results else []
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", "repo", "lab", *names, "tasks_passed", "tasks_total", "percent", "seconds", "note"])
        for r in results:
            w.writerow([r.repo.name, str(r.repo), r.lab.name, *[int(t.passed) for t in r.tasks],
                        r.n_passed, r.n_tasks, r.percent, f"{r.seconds:.1f}", r.error])
    return path


def format_lab_list(verbose: bool = False) -> str:
    lines = [f"{'#':>2}  {'lab':<18} {'time':>7}  {'tasks':>5}  title"]
    for lab in LABS.values():
        lines.append(f"{lab.number:>2}  {lab.name:<18} {lab.minutes:>4} min  {len(lab.tasks):>5}  {lab.title}")
        if verbose:
            lines.append(f"{'':>4}handout: {lab.handout}")
            lines += [f"{'':>4}write:   {fn}" for fn in lab.functions]
            lines += [f"{'':>4}task {i}: {t.name} - {t.title}" for i, t in enumerate(lab.tasks, 1)]
            lines += [f"{'':>4}target:  {x}" for x in lab.targets]
    return "\n".join(lines)


def self_check(lab: str, quick: bool = False, repo=None) -> LabResult:
    """Grade the repository this minillm was imported from, in this process, and print the score
    (the notebook's self-check cells). quick: only the lab's quick task."""
    lab_obj = get_lab(lab)
    tasks = [lab_obj.quick_task or lab_obj.tasks[0].name] if quick else None
    result = grade(repo or REPO, lab, tasks=tasks, isolated=False, tests_root=Path(repo or REPO))
    print(format_result(result))
    if quick:
        print(f"(quick: {len(result.tasks)} of {len(lab_obj.tasks)} tasks checked; run without MINILLM_QUICK for all)")
    return result


# ============================================================================ command line

def add_lab_parser(sub) -> None:
    """`python -m minillm lab {list, make, grade}` (called by minillm/__main__.py)."""
    lab = sub.add_parser("lab", help="classroom labs: list them, make a student copy, grade copies")
    lsub = lab.add_subparsers(dest="lab_command", required=True)
    ls = lsub.add_parser("list", help="the labs: name, title, time estimate, number of tasks")
    ls.add_argument("-v", "--verbose", action="store_true", help="also the functions, tasks and target numbers")
    ls.add_argument("--regions", action="store_true", help="also every solution region in this repository")
    ls.set_defaults(func=_cli_list)
    mk = lsub.add_parser("make", help="write a student copy with one lab's solutions replaced by stubs")
    mk.add_argument("lab")
    mk.add_argument("--out", required=True, help="a folder outside this repository")
    mk.add_argument("--force", action="store_true", help="replace --out if it exists")
    mk.add_argument("--git", action="store_true", help="make the copy a fresh git repository (one commit, no history)")
    mk.set_defaults(func=_cli_make)
    gr = lsub.add_parser("grade", help="run a lab's tests against one or more copies and score them",
                         description="Examples: lab grade kv_cache (this folder) | lab grade --repo DIR kv_cache | "
                                     "lab grade kv_cache --repo DIR1 DIR2 --csv scores.csv | "
                                     "lab grade kv_cache --submissions FOLDER --csv scores.csv | lab grade all --repo .")
    gr.add_argument("lab", nargs="?", help="a lab name, or 'all' (every lab, one copy)")
    gr.add_argument("--repo", nargs="+", default=None, help="copies to grade (default: the current folder)")
    gr.add_argument("--submissions", default=None, help="a folder with one copy per student (sub-folders)")
    gr.add_argument("--tasks", default=None, help="comma-separated task names (default: all)")
    gr.add_argument("--csv", default=None, help="write one row per copy here")
    gr.add_argument("--jobs", type=int, default=1, help="copies graded at the same time (default 1)")
    gr.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per copy before it counts as hung")
    gr.add_argument("--tests", action="store_true", help="also list each task's test node ids")
    gr.set_defaults(func=_cli_grade)


def _cli_list(args) -> None:
    print(format_lab_list(args.verbose))
    if args.regions:
        for r in find_regions(REPO):
            print(f"  {r.lab:<18} {r.path}:{r.begin}-{r.end}  {r.function}")


def _cli_make(args) -> None:
    done = make_student_copy(args.lab, args.out, force=args.force, git=args.git)
    lab = get_lab(args.lab)
    print(f"wrote {done['out']}: {done['files']} files; lab {lab.name}: {len(done['stubbed'])} regions stubbed")
    for r in done["stubbed"]:
        print(f"  {r.path}: {r.function}")
    print(f"handout: {lab.handout}; the student checks with: python -m minillm lab grade {lab.name}")


def _cli_grade(args) -> None:
    repos = list(args.repo or [])
    name = args.lab
    if name is None and repos and (repos[-1] in LABS or repos[-1] == "all"):
        name = repos.pop()                                # `lab grade --repo DIR1 DIR2 LAB`
    if name is None:
        raise LabError(f"which lab? one of: {', '.join(LABS)} (or all)")
    if args.submissions:
        repos += [str(p) for p in submissions_in(args.submissions)]
        if not repos:
            raise LabError(f"no sub-folder of {args.submissions} holds a minillm package")
    repos = repos or ["."]
    for r in repos:
        if not Path(r).is_dir():
            raise LabError(f"{r} is not a folder")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    if name == "all":
        if len(repos) != 1 or tasks:
            raise LabError("'all' grades every lab of ONE copy, without --tasks")
        results = grade_labs(repos[0], list(LABS), timeout=args.timeout)
        for r in results:
            print(format_result(r, args.tests))
        passed, total = sum(r.n_passed for r in results), sum(r.n_tasks for r in results)
        print(f"all: {passed}/{total} tasks, {round(100 * passed / total) if total else 0}%")
    elif len(repos) == 1:
        results = [grade(repos[0], name, tasks=tasks, timeout=args.timeout)]
        print(format_result(results[0], args.tests))
    else:
        results = grade_many(repos, name, jobs=args.jobs, tasks=tasks, timeout=args.timeout)
        width = max(len(Path(r).resolve().name) for r in repos) + 1
        for r in results:
            print(format_row(r, width))
        mean = sum(r.percent for r in results) / len(results)
        print(f"{len(results)} copies graded on {name}; mean {mean:.0f}%")
    if args.csv:
        print(f"wrote {write_csv(results, args.csv)}")
