"""The model on the paged KV cache: one forward over a variable-length batch, no padding.

The scheduler hands over, per request, a run of new tokens (a whole prompt, a prefill chunk,
or one decode token) that continues the request at position num_computed_tokens. The runner
concatenates them all into ONE flat sequence of N tokens, so every linear layer is a single
(N, dim) matmul whatever the mix of prefills and decodes:

    tokens        (N,)   the new tokens of every request, back to back
    positions     (N,)   each token's position in its own request (for RoPE)
    slot_mapping  (N,)   where its K/V goes in the paged cache (minillm/kvcache/block_manager.py)

Every layer is layer.decoder_layer, written once; only attention needs to know where one request
ends and the next begins, and that is the attention backend's business (minillm/attention/backends.py: the
Triton kernels on a GPU, a C kernel that reads each request's blocks in place on CPU, gather + SDPA
for an int8/fp8 cache), reading the step's metadata built here once (build_batch):
- decode rows (one new token each) attend together: all in one kernel call (Triton, C), or, for the
  backends that gather, in groups of rows of similar length, so that short requests are not padded
  to the longest one (group_by_length);
- a prefill chunk of T tokens after `start` cached ones attends to start + T keys, causally with an
  offset (query t sees keys 0..start + t).

How the layer runs is chosen once, here, from what the model is: its weights prepacked for the CPU
GEMM libraries, int8/int4 packs for a quantised model, the module itself otherwise (eager_weights);
a small step (at most SMALL_STEP_ROWS rows: decode tokens of a few requests, a speculative
verification or a tree of drafts, a short prompt; each row attends as a query of its own, to the keys
before its run and those of its run its mask names) runs the same layer under
torch.compile (layer.compiled_decode_layer, NEW: compiled small step) over a copy of the float weights
in row blocks (transforms.gemv_blocks), which one row reads by generated GEMV loops and several rows
by the few-row GEMM kernel (model/cpu_gemm.c); a step of more rows over prepacked weights runs it
under torch.compile as well, attention left out of the graph (layer.compiled_layer, NEW: compiled
batched step), or, where every row is a decode token and the C kernel attends, inside it (one graph per
layer, layer.compiled_decode_only_layer, NEW: decode-only step); on a GPU a step whose every row is one
decode token replays a CUDA graph (minillm/model/cuda_graphs.py).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from minillm.attention.backends import Run, choose_backend, make_backend
from minillm.attention.paged import block_table_tensor, copy_blocks, gather_blocks, gather_kv, store_kv_reference
from minillm.kernel_support.args import INTERPRETED
from . import cpu_gemm, prepacked
from .cpu_gemm import BlockedLinear
from .layer import (compiled_decode_layer, compiled_decode_only_layer, compiled_head, compiled_layer, compiled_or_eager,
                    decode_only_layer, decoder_layer, gemv,
                    paged_decode_layer)
from .llama import Llama, ModelConfig
from .mla import LatentAttention, LatentProjections
from .moe import MoE
from .positions import RopeTable, apply_rope, apply_rope_complex
from .transforms import gemv_blocks, is_fused


KV_CACHE_DTYPES = ("auto", "int8", "fp8")
SMALL_STEP_ROWS = cpu_gemm.MAX_ROWS     # a step of at most this many rows is a small step (build_batch's row tables)


class PagedKVCache:
    """Per layer K and V blocks: k, v (L, num_blocks, block_size, Hkv, D).

    kv_dtype "auto" stores K/V in the model's dtype; "int8" stores int8 values plus one fp16
    scale per (token, KV head) (minillm/quant/kv_int8.py, lesson 04): k_scale, v_scale
    (L, num_blocks, block_size, Hkv, 1); "fp8" the same with e4m3 values, kept as their uint8 bits
    (minillm/quant/kv_fp8.py). Values are quantised once, when written, and dequantised when a
    request's keys are gathered for attention.

    A multi-head latent attention model (DeepSeek, model/mla.py) caches per token and layer one latent
    key head [c ; k_rope] (r + d_rope wide) and nothing else: k (L, num_blocks, block_size, 1, r + d_rope),
    and v is a view of its first r columns (the absorbed attention's values are the latents themselves).
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", kv_dtype: str = "auto"):
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype = {kv_dtype!r} is not supported; allowed: {', '.join(map(repr, KV_CACHE_DTYPES))}")
        self.latent = cfg.mla is not None
        if self.latent and kv_dtype != "auto":
            raise ValueError(f"kv_cache_dtype = {kv_dtype!r} with a latent (MLA) cache is not built; allowed: 'auto'")
        heads, width = (1, cfg.mla.cache_width) if self.latent else (cfg.n_kv_heads, cfg.head_dim)
        shape = (cfg.n_layers, num_blocks, block_size, heads, width)
        self.quantized = kv_dtype in ("int8", "fp8")
        store = {"int8": torch.int8, "fp8": torch.uint8}.get(kv_dtype, dtype)   # fp8: e4m3 bits
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = self.k[..., :cfg.mla.kv_lora_rank] if self.latent else torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.zeros(*shape[:-1], 1, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(*shape[:-1], 1, dtype=torch.float16, device=device)
        self.dtype = dtype                                      # what attention computes in
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
        """K and V of one block, all layers: int8 and fp8 are D bytes + a 2-byte scale per token and head; a latent
        (MLA) cache one r + d_rope wide key per token and layer."""
        if cfg.mla is not None:
            return cfg.n_layers * block_size * cfg.mla.cache_width * torch.tensor([], dtype=dtype).element_size()
        if kv_dtype in ("int8", "fp8"):
            per_head = cfg.head_dim + 2
        else:
            per_head = cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
        return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * per_head

    @property
    def value_dim(self) -> int:
        """The width of an attention output row per head: D, or r for a latent cache."""
        return self.v.shape[-1]

    @property
    def nbytes(self) -> int:
        scales = 2 * self.k_scale.numel() * self.k_scale.element_size() if self.quantized else 0
        return (1 if self.latent else 2) * self.k.numel() * self.k.element_size() + scales

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write pairs (src, dst) from BlockManager.append_slots, for every layer at once."""
        caches = [t for t in (self.k, None if self.latent else self.v, self.k_scale, self.v_scale) if t is not None]
        copy_blocks(caches, copies, block_dim=1)                        # (L, num_blocks, ...) each

    def move_slots(self, src: list[int], dst: list[int]) -> None:
        """NEW: tree drafts: every layer's K/V (and scales) at slots src copied to slots dst, in one indexed copy
        per tensor (read before written: src and dst may overlap). The accepted path of a tree moves to the
        positions it now holds."""
        caches = [t for t in (self.k, None if self.latent else self.v, self.k_scale, self.v_scale) if t is not None]
        src_t, dst_t = (torch.tensor(x, dtype=torch.long, device=self.k.device) for x in (src, dst))
        for t in caches:
            flat = t.view(t.shape[0], -1, *t.shape[3:])                 # (L, num_blocks * bs, ...)
            flat[:, dst_t] = flat[:, src_t]

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v (N, Hkv, D) into their slots (N,), all real: a row scatter (quantised first for int8/fp8). A latent
        cache stores k only (v is its view)."""
        if self.latent:
            self.k[layer].view(-1, *self.k.shape[3:]).index_copy_(0, slot_mapping, k.to(self.k.dtype))
            return
        store_kv_reference(k, v, self.k[layer], self.v[layer], slot_mapping, *self._scales(layer),
                           skip_padding=False)

    def gather(self, layer: int, block_tables: torch.Tensor, out: tuple | None = None):
        """Whole blocks of (B, n) block tables -> K, V (B, n * block_size, Hkv, D) in the compute
        dtype (attention.paged.gather_kv; past each length: stale, mask it). out: two buffers to reuse.
        A latent cache gathers its keys once; the values are their first r columns."""
        if self.latent:
            keys = gather_blocks(self.k[layer], block_tables, None if out is None else out[0])   # (B, n * bs, 1, r + d_rope)
            return keys, keys[..., :self.v.shape[-1]]
        return gather_kv(self.k[layer], self.v[layer], block_tables, *self._scales(layer), self.dtype, out)

    def _scales(self, layer: int) -> tuple:
        """One layer's (k_scale, v_scale) of an int8 or fp8 cache, (None, None) otherwise."""
        return (self.k_scale[layer], self.v_scale[layer]) if self.quantized else (None, None)


# One more attention call per layer (two block copies + one SDPA) costs about as much as
# copying and reading GROUP_COST_BLOCKS blocks more (a break-even measured on CPU in bf16; re-measure elsewhere).
GROUP_COST_BLOCKS = 16


def group_by_length(num_blocks: list[int], cost: int = GROUP_COST_BLOCKS) -> list[list[int]]:
    """Split decode rows into groups, each padded only to its own longest row: the partition
    with the fewest (blocks copied + `cost` per group), exactly (dynamic programming over the
    rows sorted by length). -> lists of row indices; one group keeps the original order."""
    order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
    n = [num_blocks[i] for i in order]                                  # ascending
    best, cut = [0] + [math.inf] * len(n), [0] * (len(n) + 1)
    for j in range(1, len(n) + 1):                                      # rows order[i:j] form the last group
        for i in range(j):
            c = best[i] + cost + (j - i) * n[j - 1]
            if c < best[j]:
                best[j], cut[j] = c, i
    groups, j = [], len(n)
    while j:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return [list(range(len(n)))] if len(groups) == 1 else groups[::-1]


# Runs of up to this many tokens that continue a cached request (a decode token plus speculative
# drafts: 1 + speculative.MAX_SPECULATIVE_TOKENS) join the decode groups of the gathering CPU backends
# instead of running attention one request at a time like a prefill chunk (the C and Triton kernels take
# one query per row: there such runs attend as prefill chunks).
MAX_GROUPED_QUERIES = 17


@dataclass
class DecodeGroup:
    """Requests whose keys are copied and attended together on CPU (padded to the group's longest):
    each has Tq query rows or fewer (1 for a plain decode, 1 + k for a speculative verification)."""
    rows: torch.Tensor             # (Bg, Tq) rows of the batch (padding: repeats a real row)
    real: torch.Tensor             # (Bg, Tq) True where a query row is real
    tables: torch.Tensor           # (Bg, n) int64 block tables (padding: block 0)
    mask: torch.Tensor             # (Bg, 1, Tq, n * block_size) True where query t may see key j
    seq_lens: torch.Tensor         # (Bg,) int64 keys the last query of each request sees


@dataclass
class PagedBatch:
    """Everything one forward needs; built once per step, shared by all layers."""
    tokens: torch.Tensor           # (N,) int64
    positions: torch.Tensor        # (N,) int64
    slot_mapping: torch.Tensor     # (N,) int64
    logits_rows: torch.Tensor      # (K,) rows of the N whose logits are returned
    decode_rows: torch.Tensor      # (Bd,) rows that are single decode tokens
    decode_tables: torch.Tensor    # (Bd, max_blocks) int32 block tables, for the one-call kernels (Triton, C)
    decode_lens: torch.Tensor      # (Bd,) int32 keys per decode row, for the same
    decode_groups: list            # [DecodeGroup], for the CPU path
    prefills: list                 # [attention.Run] with blocks (1, n) int32: runs attended one by one
    grouped_runs: list             # [attention.Run] runs of T > 1 inside decode_groups (speculative drafts)
    window: int | None = None      # the sliding window the decode groups' masks apply (None: full attention)
    feature_rows: torch.Tensor | None = None   # (F,) rows whose top-layer features are returned too (EAGLE drafts)
    row_tables: torch.Tensor | None = None     # (N, n) int64 each row's block table, for a small step (None: N > SMALL_STEP_ROWS)
    row_lens: torch.Tensor | None = None       # (N,) int64 its position + 1 (where a sliding window starts), for the same
    has_tree: bool = False                     # NEW: tree drafts: a run's rows branch (only a small step takes it)
    run_starts: torch.Tensor | None = None     # (N,) int64 with a tree: the first key of each row's run; it sees every
    run_masks: torch.Tensor | None = None      # key before and the run's keys whose bits are set (decode_attention_fused)


def build_batch(runs: list[tuple], want_logits: list[str],
                block_size: int, device, group_cost: int | None = GROUP_COST_BLOCKS,
                window: int | None = None, want_features: list[bool] | None = None) -> PagedBatch:
    """runs: per request (new token ids, start position, block table, slots of the new tokens), and optionally
    a fifth item, the run's tree (NEW: tree drafts): parents[t] the row of the run that row t follows (-1 for
    row 0), so row t sits at position start + its depth and sees its ancestors' keys and its own (a chain,
    parents[t] = t - 1, is the plain run). Only a small step takes a tree.
    want_logits per run: "last" (the last row), "all" (every row) or "none".
    want_features per run: every row's top-layer feature is returned too (forward_with_features).
    group_cost None: no decode groups (the Triton or C kernel takes every length in one call).
    window: the model's sliding window, which the decode groups' masks apply."""
    tokens, positions, slots, logits_rows, feature_rows = [], [], [], [], []
    dec_rows, dec_lens, dec_tables, prefills = [], [], [], []
    small = sum(len(new) for new, *_ in runs) <= SMALL_STEP_ROWS
    row_tables, run_bits = [], []                    # a small step: every row a query of its own
    has_tree = False
    short = []                                       # (row, T, start, table): runs for the CPU groups
    row = 0
    for i, ((new, start, table, new_slots, *tree), want) in enumerate(zip(runs, want_logits)):
        T = len(new)
        if want_features is not None and want_features[i]:
            feature_rows += range(row, row + T)
        tokens += new
        if tree and tree[0] is not None:             # NEW: tree drafts
            if not small:
                raise ValueError(f"a tree of {T} rows in a step of {sum(len(r[0]) for r in runs)} rows: tree drafts "
                                 f"need a small step (at most {SMALL_STEP_ROWS} rows)")
            has_tree = True
            depths, masks = run_tree(tree[0])
            positions += [start + d for d in depths]
        else:                                        # a causal run: row t at start + t, seeing rows 0 .. t
            masks = None
            positions += range(start, start + T)
        if small:
            run_bits.append((start, T, masks))
        slots += new_slots
        if want == "all":
            logits_rows += range(row, row + T)
        elif want == "last":
            logits_rows.append(row + T - 1)
        table = table[:math.ceil((start + T) / block_size)]
        if small:
            row_tables += [table] * T
        if T == 1:
            dec_rows.append(row)
            dec_lens.append(start + 1)
            dec_tables.append(table)
        if group_cost is not None and (T == 1 or (start > 0 and T <= MAX_GROUPED_QUERIES)):
            short.append(Run(row, T, start, table))  # NEW: speculative, verified with the decodes
        elif T > 1:
            prefills.append(Run(row, T, start, table, block_table_tensor([table], device)))   # (1, n) table
        row += T
    groups = []
    if short:
        for members in group_by_length([len(short[i].table) for i in range(len(short))], group_cost):
            groups.append(_decode_group([short[i] for i in members], block_size, device, window))
    as_long = dict(dtype=torch.long, device=device)
    small_step = {}
    if small:                                        # row t of a run at `start` sees keys 0 .. start + t
        small_step = dict(row_tables=block_table_tensor(row_tables, device).long(),
                          row_lens=torch.tensor(positions, **as_long) + 1, has_tree=has_tree)
        if has_tree:                                 # only a tree reads them: other steps keep their graphs
            starts = [start for start, T, _ in run_bits for _ in range(T)]
            masks = [m for _, T, bits in run_bits for m in (bits or [(2 << t) - 1 for t in range(T)])]
            small_step.update(run_starts=torch.tensor(starts, **as_long), run_masks=torch.tensor(masks, **as_long))
    return PagedBatch(torch.tensor(tokens, **as_long), torch.tensor(positions, **as_long),
                      torch.tensor(slots, **as_long), torch.tensor(logits_rows, **as_long),
                      torch.tensor(dec_rows, **as_long), block_table_tensor(dec_tables, device),
                      torch.tensor(dec_lens, dtype=torch.int32, device=device), groups, prefills,
                      [r for r in short if r.length > 1], window,
                      torch.tensor(feature_rows, **as_long) if feature_rows else None, **small_step)


def run_tree(parents: list[int]) -> tuple[list[int], list[int]]:
    """parents[t]: the row row t follows (-1: none; each parent before its child) -> each row's depth and its
    mask: bit j set where row j is the row itself or an ancestor (the keys of its run it sees)."""
    depths, masks = [], []
    for t, p in enumerate(parents):
        if not (p == -1 if t == 0 else 0 <= p < t):
            raise ValueError(f"run tree: row {t}'s parent is {p}; allowed: -1 for row 0, a row before it otherwise")
        depths.append(0 if p < 0 else depths[p] + 1)
        masks.append((1 << t) | (0 if p < 0 else masks[p]))
    return depths, masks


def _decode_group(members: list[Run], block_size: int, device, window: int | None = None) -> DecodeGroup:
    """members: the runs of the group's requests. Query t of a request sees its keys 0..start + t
    (causal within its own new tokens; with a sliding window, only the last `window` of them);
    padded query rows see what the request's first query sees. Built from Python lists,
    a handful of tensors: at batch 1 this runs every decode step."""
    Tq = max(r.length for r in members)
    tables = block_table_tensor([r.table for r in members]).long()                # (Bg, n)
    steps = range(Tq)
    rows = [[r.row + min(t, r.length - 1) for t in steps] for r in members]       # (Bg, Tq)
    real = [[t < r.length for t in steps] for r in members]                       # (Bg, Tq)
    visible = torch.tensor([[r.start + (t if t < r.length else 0) for t in steps]
                            for r in members])                                    # (Bg, Tq) last key seen
    keys = torch.arange(tables.shape[1] * block_size)                             # (n * bs,)
    mask = keys[None, None, :] <= visible[:, :, None]                             # (Bg, Tq, n * bs)
    if window is not None:
        mask &= keys[None, None, :] > visible[:, :, None] - window
    seq_lens = torch.tensor([r.start + r.length for r in members])                # (Bg,)
    return DecodeGroup(torch.tensor(rows, device=device), torch.tensor(real, device=device), tables.to(device),
                       mask[:, None].to(device), seq_lens.to(device))


class Stacked:
    """Projections that read the same input, applied side by side and concatenated: q, k, v (or
    gate, up) of a model whose projections could not be fused into one matrix (quantised ones
    without a CPU kernel). x (N, in) -> (N, sum out)."""

    def __init__(self, modules):
        self.modules = list(modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([m(x) for m in self.modules], dim=-1)


class PackedProjection:
    """Quantised projections that read one input (wq, wk, wv; w_gate, w_up; or one alone) as ONE int8/int4
    kernel call for up to the kernels' row limit (cpu_kernels.KERNEL_MAX_ROWS: decode steps), and the
    modules themselves above it (a prefill: dequantise once, then a GEMM). x (N, in) -> (N, sum out)."""

    def __init__(self, pack: tuple, modules, max_rows: int):
        self.pack, self.max_rows = pack, max_rows                    # (weight, scale, group, perm)
        self.modules = modules[0] if len(modules) == 1 else Stacked(modules)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.max_rows:
            from minillm.quant.cpu_kernels import packed_mm
            return packed_mm(x, *self.pack)
        return self.modules(x)


class ModelRunner:
    """Runs PagedBatches of one model over one PagedKVCache, every layer by layer.decoder_layer."""

    def __init__(self, model: Llama, kv: PagedKVCache, rope: RopeTable, prepack_rows: int | None = None,
                 triton_on_cpu: bool = False, tune_kernels: bool = True, compile_steps: bool = False,
                 attention_backend: str = "sdpa"):
        """prepack_rows: on CPU, lay the float weights out once for batches of about this many rows
        (minillm/model/prepacked.py; the engine passes max_num_seqs); None: plain F.linear.
        tune_kernels: the build's one timing step: MKL against oneDNN per weight shape
        (prepacked.choose_libraries); False: the recorded defaults. What was chosen: self.gemm_libraries.
        compile_steps: on CPU, a small step runs the same layer under torch.compile
        (layer.compiled_decode_layer) over the weights as int8/int4 packs or, float ones, as a copy in
        row blocks (transforms.gemv_blocks), W8A8 ones as StackedW8A8: up to SMALL_STEP_ROWS rows where the
        few-row GEMM kernel builds and takes the float blocks (cpu_gemm.BlockedLinear), else one row
        (small_step_rows); a step of more rows, where every projection is prepacked or W8A8, runs it
        under torch.compile with attention outside the graph (layer.compiled_layer), or inside it for a
        step of decode tokens only where the C kernel attends (layer.compiled_decode_only_layer).
        triton_on_cpu: run the GPU path (Triton store + paged decode kernel) on CPU tensors under
        TRITON_INTERPRET=1, so that tests on a CPU machine cover what a GPU runs.
        attention_backend: how prefill runs attend (model.ATTENTION_BACKENDS); the paged backend itself
        (attention.BACKENDS) follows from the device and the cache, in self.attention."""
        self.model, self.kv, self.rope = model, kv, rope
        self.fused = is_fused(model)            # fused QKV / gate-up (not for quantised models)
        self.gemm_libraries: dict[str, str] = {}                        # library_key -> "mkl" | "onednn"
        if triton_on_cpu and kv.k.device.type == "cpu" and not INTERPRETED:
            raise ValueError("triton_on_cpu=True needs TRITON_INTERPRET=1 in the environment before minillm "
                             "is imported (the Triton kernels run on CPU only in the interpreter)")
        self.graphs = None                      # NEW: CUDA graphs; a cuda_graphs.DecodeGraphs set by the engine
        self.compiled_decode_steps = 0          # tests prove the compiled small step ran
        self.compiled_batched_steps = 0         # ... and the compiled batched step
        self.compiled_decode_only_steps = 0     # ... and, of those, the decode-only ones in one graph per layer
        self.compile_failed: str | None = None  # why torch.compile could not build here: eager from then on
        self.window = model.cfg.sliding_window  # each row sees its last `window` keys (Mistral); None: all
        self.attention = make_backend(choose_backend(kv, triton_on_cpu, model.cfg.n_heads), kv, attention_backend,
                                      self._run, self.window)
        self.prepacking = prepack_rows is not None and self.fused and kv.k.device.type == "cpu"
        if self.prepacking:                     # the build's one GEMM timing step (or the recorded defaults)
            self.gemm_libraries = prepacked.choose_libraries(self._prepackable_weights(), prepack_rows, tune_kernels)
        self.layer_weights, self.packed_head = self._eager_weights(prepack_rows, self.gemm_libraries)
        self.decode_weights = self.decode_head = None   # the compiled step's layers and tied head (row blocks)
        self.small_step_rows = 1                        # the most rows a step may have to run compiled
        if compile_steps and self.attention.name in ("cpu", "cpu-fused"):
            self.decode_weights, self.decode_head = self._compiled_weights()
        self.compile_batched = compile_steps and self._graph_projections()

    def drop_prepacked(self) -> None:
        """Run on plain F.linear from now on (frees the packed copies; bench engine-step compares)."""
        self.prepacking, self.gemm_libraries, self.compile_batched = False, {}, False
        self.layer_weights, self.packed_head = self._eager_weights(None, {})

    # --- the weights each layer is run with (layer.decoder_layer's `weights`) -------------------
    def _prepackable_weights(self) -> list[torch.Tensor]:
        """The weights prepacking may lay out: every bias-free fused projection and the tied LM head."""
        model = self.model
        linears = []
        for layer in model.layers:
            attn, ffn = layer.attn, layer.ffn
            linears += [attn.wqkv, attn.wo, getattr(attn, "wq_b", None)]       # MLA's query up-projection too
            linears += [] if isinstance(ffn, MoE) else [ffn.w_gate_up, ffn.w_down]
        weights = [m.weight for m in linears if type(m) is torch.nn.Linear and m.bias is None]
        return weights + ([model.embed.weight] if model.lm_head is None else [])

    def _graph_projections(self) -> bool:
        """Every projection of every layer is one the compiled batched step can trace: a prepacked GEMM
        (its op) or a StackedW8A8 (quantise, int8 GEMM, rescale)."""
        from minillm.quant.w8a8 import StackedW8A8

        kinds = (prepacked.PrepackedLinear, StackedW8A8)
        return all(isinstance(p, kinds) for w in self.layer_weights for p in (w[1], w[2], w[4], w[5]))

    def _eager_weights(self, rows: int | None, libraries: dict[str, str]) -> tuple[list, prepacked.PrepackedLinear | None]:
        """-> per layer (attn_norm, qkv, wo, ffn_norm, gate_up, down, qk_norm) for the eager forward, each
        projection prepacked for `rows` rows by the library `libraries` names for its shape (empty:
        none), an int8/int4 pack, or the module itself; and the prepacked tied LM head or None."""
        model = self.model
        head = model.embed.weight if model.lm_head is None else None
        packed_head = prepacked.prepack_or_none(head, rows, libraries) if libraries and head is not None else None

        def eager(module):
            found = prepacked.prepack_or_none(module, rows, libraries) if libraries else None
            if found is not None:                                        # NEW: prepacked
                return found
            return functools.partial(gemv_linear, module) if type(module) is torch.nn.Linear else module

        out = []
        for layer in model.layers:
            attn, ffn = layer.attn, layer.ffn
            if isinstance(attn, LatentAttention):                        # MLA: absorbed, over the latent cache
                qkv = LatentProjections(attn, eager(attn.wqkv), eager(attn.wq_b) if attn.shape.q_lora_rank else None)
            elif self.fused:
                qkv = eager(attn.wqkv)
            else:                                                        # quantised: packs, or side by side
                qkv = _packs([attn.wq, attn.wk, attn.wv], model) or Stacked([attn.wq, attn.wk, attn.wv])
            if isinstance(ffn, MoE):                                     # the whole MLP: route, experts, add
                gate_up, down = ffn, None
            elif self.fused:
                gate_up, down = eager(ffn.w_gate_up), eager(ffn.w_down)
            else:
                gate_up = _packs([ffn.w_gate, ffn.w_up], model) or Stacked([ffn.w_gate, ffn.w_up])
                down = _packs([ffn.w_down], model) or eager(ffn.w_down)
            wo = (None if self.fused else _packs([attn.wo], model)) or eager(attn.wo)
            qk_norm = None if getattr(attn, "q_norm", None) is None or isinstance(attn, LatentAttention) else \
                (attn.q_norm.weight.detach(), attn.k_norm.weight.detach())
            out.append((layer.attn_norm.weight.detach(), qkv, wo, layer.ffn_norm.weight.detach(), gate_up, down,
                        qk_norm))
        return out, packed_head

    def _compiled_weights(self) -> tuple[list | None, torch.Tensor | None]:
        """-> per layer the weights of the compiled small step, and the tied LM head (None: untied).
        A float model whose fused projections are bias-free nn.Linears: copies in row blocks, the head
        too (transforms.gemv_blocks, NEW); a quantised one: its int8/int4 packs and the head as it is;
        (None, None) where a projection is neither."""
        model, layers = self.model, []
        if model.cfg.mla is not None or model.cfg.moe is not None:       # it compiles the Llama layer's GQA and MLP
            return None, None
        for layer, eager in zip(model.layers, self.layer_weights):
            attn, ffn = layer.attn, layer.ffn
            if self.fused:
                linears = (attn.wqkv, attn.wo, ffn.w_gate_up, ffn.w_down)
                if any(type(m) is not torch.nn.Linear or m.bias is not None for m in linears):
                    return None, None
                projections = [m.weight.detach() for m in linears]
            else:                                                        # int8/int4 packs, or W8A8 stacks
                from minillm.quant.w8a8 import StackedW8A8

                projections = [eager[1], eager[2], eager[4], eager[5]]
                if not all(isinstance(p, (PackedProjection, StackedW8A8)) for p in projections):
                    return None, None
                projections = [p.pack if isinstance(p, PackedProjection) else p for p in projections]
            layers.append([eager[0], projections[0], projections[1], eager[3], projections[2], projections[3], eager[6]])
        head = model.embed.weight.detach() if model.lm_head is None else None
        if self.fused:                                                    # all copies in one buffer
            slots = [(layer, j) for layer in layers for j in (1, 2, 4, 5)]
            blocks = gemv_blocks([layer[j] for layer, j in slots] + ([head] if head is not None else []))
            head = blocks[-1] if head is not None else None               # the head stays a tensor in row blocks
            if all(cpu_gemm.usable(b) for b in blocks):                   # NEW: the few-row kernel, up to 8 rows
                blocks = [BlockedLinear(b) for b in blocks]
                self.small_step_rows = SMALL_STEP_ROWS
            for (layer, j), b in zip(slots, blocks):
                layer[j] = b
        return [tuple(layer) for layer in layers], head

    @property
    def packed_layers(self) -> list[tuple] | None:
        """Per layer its (qkv, wo, gate_up, down) projections where they are prepacked GEMMs (a
        projection that could not be prepacked: None), or None where the weights are not prepacked
        (no prepack_rows, a quantised model, a GPU, or drop_prepacked)."""
        if not self.prepacking:
            return None
        return [tuple(p if isinstance(p, prepacked.PrepackedLinear) else None for p in (w[1], w[2], w[4], w[5]))
                for w in self.layer_weights]

    @property
    def use_triton(self) -> bool:
        """Decode rows go through the Triton kernels (the GPU path; CUDA graphs need it)."""
        return self.attention.name == "triton"

    def _run(self, compiled, eager, *args):
        """layer.compiled_or_eager, recording a compiler failure in self.compile_failed."""
        return compiled_or_eager(self, compiled, eager, *args)

    @property
    def graph_replays(self) -> int:
        """How many steps replayed a CUDA graph (0 without graphs): tests prove the graph path ran."""
        return 0 if self.graphs is None else self.graphs.replays

    @torch.no_grad()
    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """-> logits (K, V) of batch.logits_rows."""
        self._refuse_a_tree_it_cannot_take(batch)
        if self.graphs is not None and self.graphs.fits(batch):         # NEW: CUDA graphs, decode-only steps
            return self.graphs.run(batch)
        if self._runs_small_step(batch):                                # NEW: compiled small step
            return self._decode_logits(self._decode_layers(batch)[batch.logits_rows])
        return self.forward_eager(batch)

    def _runs_small_step(self, batch: PagedBatch) -> bool:
        """The compiled small step takes the batch: at most small_step_rows rows. A tree of drafts runs there
        even where compiling failed (eagerly): no other path reads its masks."""
        fits = (self.decode_weights is not None and batch.row_lens is not None
                and batch.tokens.shape[0] <= self.small_step_rows)
        return fits and (self.compile_failed is None or batch.has_tree)

    def _refuse_a_tree_it_cannot_take(self, batch: PagedBatch) -> None:
        """A tree of drafts runs only in the small step (its masks): ValueError for one in a bigger step."""
        rows = batch.tokens.shape[0]
        if batch.has_tree and rows > self.tree_rows:
            raise ValueError(f"a tree of drafts in a step of {rows} rows: this runner takes trees in steps of "
                             f"at most {self.tree_rows} rows (tree_rows)")

    @property
    def tree_rows(self) -> int:
        """NEW: tree drafts: the most rows a step with a tree may have (0: none; the small step's masks only)."""
        return self.small_step_rows if self.decode_weights is not None else 0

    @torch.no_grad()
    def forward_eager(self, batch: PagedBatch) -> torch.Tensor:
        """-> logits (K, V) of batch.logits_rows, op by op (a CUDA graph records this)."""
        return self._logits(self.forward_layers(self.model.embed(batch.tokens), batch), batch)

    @torch.no_grad()
    def forward_with_features(self, batch: PagedBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """NEW: EAGLE -> logits (K, V) of batch.logits_rows and the features (F, dim) of batch.feature_rows: the
        hidden states after the final norm, what the LM head reads and an EAGLE head drafts from."""
        self._refuse_a_tree_it_cannot_take(batch)
        if self._runs_small_step(batch):                                # NEW: compiled small step
            h = self._decode_layers(batch)                               # (N, dim)
            return self._decode_logits(h[batch.logits_rows]), self.model.norm(h[batch.feature_rows])
        h = self.forward_layers(self.model.embed(batch.tokens), batch)   # (N, dim)
        return self._logits(h, batch), self.model.norm(h[batch.feature_rows])

    def _logits(self, h: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """h (N, dim) before the final norm -> logits (K, V) of batch.logits_rows."""
        if self.packed_head is not None:                                 # NEW: prepacked
            return prepacked.lm_head(self.packed_head, self.model, h[batch.logits_rows])
        return tied_logits(self.model, h[batch.logits_rows])             # (K, V)

    @torch.no_grad()
    def forward_layers(self, h: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """h (N, dim) through every layer of self.model (a pipeline stage runs only its own)."""
        cfg = self.model.cfg
        self.attention.begin_step(batch)
        if self.compile_batched and h.shape[0] > 1 and self.compile_failed is None:
            return self._forward_layers_compiled(h, batch)               # NEW: compiled batched step
        rotation = self.rope.rotation[batch.positions][:, None]          # (N, 1, D/2) complex
        rope = functools.partial(apply_rope_complex, rotation=rotation)  # one complex multiply for q and k
        for i, weights in enumerate(self.layer_weights):
            attention = functools.partial(self.attention.forward, i, batch=batch)   # (q, k, v) -> (N, Hq, D)
            h = decoder_layer(h, weights, rope, attention, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps)
        return h

    def _forward_layers_compiled(self, h: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """forward_layers by layer.compiled_layer (eagerly, where compiling fails): the layer's pieces
        between attention calls compiled once for any row count N >= 2 (marked symbolic), attention
        run by the backend outside the graph, RoPE by cos and sin (Inductor generates no complex
        arithmetic)."""
        cfg = self.model.cfg
        cos, sin = self._cos_sin(batch.positions)                        # (N, 1, D/2) each
        for t in (h, cos, sin):
            torch._dynamo.mark_dynamic(t, 0)
        self.compiled_batched_steps += 1
        if self._attends_in_graph(batch):                                # NEW: decode rows only, one graph a layer
            return self._decode_only_layers(h, cos, sin, batch)
        rope = functools.partial(apply_rope, cos=cos, sin=sin)
        for i, weights in enumerate(self.layer_weights):
            attention = functools.partial(attention_outside_graph(), self.attention, i, batch)   # (q, k, v) -> (N, Hq, D)
            h = self._run(compiled_layer, decoder_layer, h, weights, rope, attention, cfg.n_heads, cfg.n_kv_heads,
                          cfg.norm_eps)
        return h

    def _attends_in_graph(self, batch: PagedBatch) -> bool:
        """Every row of the batch is a decode token and the C kernel attends: its op can sit inside the layer's graph."""
        return self.attention.name == "cpu" and batch.decode_rows.shape[0] == batch.tokens.shape[0]

    def _decode_only_layers(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """NEW: a step of decode tokens only, more rows than the small step takes, through every layer by the compiled
        layer.decode_only_layer (eagerly, where compiling fails): each layer ONE graph, the prepacked GEMMs and the
        C decode kernel's op inside it, instead of two graphs around an attention call outside."""
        cfg = self.model.cfg
        tables, k_caches, v_caches = self._in_place_reads(batch.decode_tables)   # (N, n >= 2) int32
        for t in (batch.slot_mapping, tables, batch.decode_lens):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        for i, weights in enumerate(self.layer_weights):
            h = self._run(compiled_decode_only_layer, decode_only_layer, h, weights, cos, sin, k_caches[i], v_caches[i],
                          batch.slot_mapping, tables, batch.decode_lens, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps,
                          self.window)
        self.compiled_decode_only_steps += 1
        return h

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos and sin at each row's position, (N, 1, D/2) each."""
        return self.rope.cos[positions][:, None], self.rope.sin[positions][:, None]

    def _in_place_reads(self, tables: torch.Tensor) -> tuple:
        """For a compiled step that reads the paged cache in place: the block tables (N, n) padded to at least 2
        blocks (a repeat past each row's length, masked: torch would specialise a size of 1 into a graph of its own)
        and every layer's K and V cache views (num_blocks, bs, Hkv, D); the blocks per row and the pool's size
        (which differs per engine) marked symbolic."""
        tables = tables if tables.shape[1] > 1 else tables.repeat(1, 2)  # (N, n >= 2)
        torch._dynamo.maybe_mark_dynamic(tables, 1)
        k_caches, v_caches = self.kv.k.unbind(0), self.kv.v.unbind(0)   # L x (num_blocks, bs, Hkv, D) views
        for cache in (k_caches[0], v_caches[0]):
            torch._dynamo.maybe_mark_dynamic(cache, 0)
        return tables, k_caches, v_caches

    @torch.no_grad()
    def _decode_layers(self, batch: PagedBatch) -> torch.Tensor:
        """A small step (1 .. small_step_rows rows) through every layer by the compiled layer.paged_decode_layer
        (eagerly, where compiling fails) -> h (N, dim) before the final norm. Every row is a query of its own:
        its K/V is stored first, then it attends to its request's keys up to its own position (row_lens), so
        a decode token, a speculative verification and a short prefill chunk are the same computation; a tree
        of drafts (NEW) attends instead to the keys before its run and, of the run's, its ancestors' and its own
        (run_starts, run_masks). One graph for one row, one for 2 .. small_step_rows (the row count marked
        symbolic), one for a tree."""
        cfg = self.model.cfg
        tables, k_caches, v_caches = self._in_place_reads(batch.row_tables)
        cos, sin = self._cos_sin(batch.positions)                        # (N, 1, D/2) each
        h = self.model.embed.weight.detach()[batch.tokens]               # (N, dim) gathered: not a view
        runs = (batch.run_starts, batch.run_masks) if batch.has_tree else None
        rows = (h, cos, sin, batch.slot_mapping, tables, batch.row_lens, *(runs or ()))
        if h.shape[0] > 1:
            for t in rows:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        for i, weights in enumerate(self.decode_weights):
            h = self._run(compiled_decode_layer, paged_decode_layer, h, weights, cos, sin, k_caches[i], v_caches[i],
                          batch.slot_mapping, tables, batch.row_lens, cfg.n_heads, cfg.n_kv_heads, cfg.norm_eps,
                          self.window, runs)
        self.compiled_decode_steps += 1
        return h

    def _decode_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h (K, dim) of the compiled small step's logits rows -> logits (K, V)."""
        if self.model.lm_head is not None:                               # an untied or quantised head
            return self.model.logits(h)                                  # (K, V)
        x = self.model.norm(h)                                           # (K, dim)
        if x.shape[0] == 0:                                              # a prefill chunk that is not a prompt's last
            return x.new_empty(0, self.model.cfg.vocab_size)
        if x.shape[0] > 1:                                               # the runner makes K > 1 only with the kernel
            return torch.ops.minillm.blocked_gemm(x, self.decode_head)   # (K, V): the tied head by the few-row kernel
        return self._run(compiled_head, gemv, self.decode_head, x[0])[None]   # (1, V): the tied head as one GEMV


@functools.cache
def attention_outside_graph():
    """The backends' forward_outside_graph under torch.compiler.disable (a graph break: the compiled batched
    step's graphs end before it and resume after it), built at first use: torch.compiler imports Dynamo."""
    from minillm.attention.backends import TorchBackend

    return torch.compiler.disable(TorchBackend.forward_outside_graph)


def _packs(modules, model: Llama):
    """Quantised projections that read one input as a PackedProjection (quant/cpu_kernels.fused_pack) or,
    W8A8 ones, as a StackedW8A8; None (not all QuantLinears, no CPU kernel, or kernels switched off by
    cpu_kernels.reference_path)."""
    from minillm.quant import cpu_kernels
    from minillm.quant.linear import QuantLinear
    from minillm.quant.w8a8 import StackedW8A8

    dtype = model.embed.weight.dtype
    if model.embed.weight.device.type != "cpu" or not all(type(m) is QuantLinear and m.use_cpu_kernel for m in modules):
        return None
    if all(m.fmt == "w8a8" and m.bias is None for m in modules):        # NEW: W8A8, one int8 GEMM
        return StackedW8A8(modules)
    pack = cpu_kernels.fused_pack(modules, dtype)
    return None if pack is None else PackedProjection(pack, modules, cpu_kernels.KERNEL_MAX_ROWS.get(dtype, 0))


def gemv_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """module(x), with a single row (one decode token) as the BLAS matrix-vector product."""
    if x.shape[0] == 1:
        y = torch.mv(module.weight, x[0])                                # (out,)
        return (y if module.bias is None else y + module.bias)[None]
    return module(x)


def tied_logits(model: Llama, h: torch.Tensor) -> torch.Tensor:
    """model.logits(h) for h (K, dim), with one row through a tied head as torch.mv."""
    if model.lm_head is None and h.shape[0] == 1:
        return torch.mv(model.embed.weight, model.norm(h)[0])[None]      # (1, V)
    return model.logits(h)
