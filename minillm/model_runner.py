"""The model on the paged KV cache: one forward over a variable-length batch, no padding.

The scheduler hands over, per request, a run of new tokens (a whole prompt, a prefill chunk,
or one decode token) that continues the request at position num_computed_tokens. The runner
concatenates them all into ONE flat sequence of N tokens, so every linear layer is a single
(N, dim) matmul whatever the mix of prefills and decodes:

    tokens        (N,)   the new tokens of every request, back to back
    positions     (N,)   each token's position in its own request (for RoPE)
    slot_mapping  (N,)   where its K/V goes in the paged cache (minillm/block_manager.py)

Only attention needs to know where one request ends and the next begins:
- decode rows (one new token each) attend together: on a GPU the Triton kernel walks each
  block table (kernels/paged_attention.py); on CPU, in groups of rows of similar length so
  that short requests are not padded to the longest one (group_by_length), by a compiled
  kernel that reads each request's blocks straight from the cache
  (paged_attention.decode_attention_fused, NEW: fused decode attention); where compiling is
  unavailable, and for an int8/fp8 cache or speculative runs, we copy each request's blocks
  (whole blocks, into one buffer reused by every layer) into a padded (Bg, L_pad, Hkv, D)
  batch and run torch's SDPA with a padding mask;
- a prefill chunk of T tokens after `start` cached ones attends to start + T keys, causally
  with an offset (query t sees keys 0..start + t).
On CPU a bf16/fp16 model attends in fp32 (sdpa): torch's 2-byte CPU SDPA kernel is slower than
converting q, K and V to fp32 and running the fp32 one (bench engine-step measures both; lesson 07).

Compared with forward_fast (the contiguous batch-1 path) what is new is marked  # NEW: paged.
A step whose every row is one decode token replays a CUDA graph on a GPU (minillm/cuda_graphs.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import fast_decode, prepacked
from .kernel_args import INTERPRETED
from .fast_decode import is_fused, linear, lm_head, rms_norm
from .model import Llama, ModelConfig
from .paged_attention import block_table_tensor, copy_blocks, decode_attention_fused, gather_kv, store_kv_reference
from .positions import RopeTable, apply_rope_complex, causal_mask


KV_CACHE_DTYPES = ("auto", "int8", "fp8")


class PagedKVCache:
    """Per layer K and V blocks: k, v (L, num_blocks, block_size, Hkv, D).

    kv_dtype "auto" stores K/V in the model's dtype; "int8" stores int8 values plus one fp16
    scale per (token, KV head) (minillm/quant/kv_int8.py, lesson 04): k_scale, v_scale
    (L, num_blocks, block_size, Hkv, 1); "fp8" the same with e4m3 values, kept as their uint8 bits
    (minillm/quant/kv_fp8.py). Values are quantised once, when written, and dequantised when a
    request's keys are gathered for attention.
    """

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", kv_dtype: str = "auto"):
        if kv_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype = {kv_dtype!r} is not supported; allowed: {', '.join(map(repr, KV_CACHE_DTYPES))}")
        shape = (cfg.n_layers, num_blocks, block_size, cfg.n_kv_heads, cfg.head_dim)
        self.quantized = kv_dtype in ("int8", "fp8")
        store = {"int8": torch.int8, "fp8": torch.uint8}.get(kv_dtype, dtype)   # fp8: e4m3 bits
        self.k = torch.zeros(shape, dtype=store, device=device)
        self.v = torch.zeros(shape, dtype=store, device=device)
        self.k_scale = self.v_scale = None
        if self.quantized:
            self.k_scale = torch.zeros(*shape[:-1], 1, dtype=torch.float16, device=device)
            self.v_scale = torch.zeros(*shape[:-1], 1, dtype=torch.float16, device=device)
        self.dtype = dtype                                      # what attention computes in
        self.num_blocks, self.block_size = num_blocks, block_size

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_dtype: str = "auto") -> int:
        """K and V of one block, all layers: int8 and fp8 are D bytes + a 2-byte scale per token and head."""
        if kv_dtype in ("int8", "fp8"):
            per_head = cfg.head_dim + 2
        else:
            per_head = cfg.head_dim * torch.tensor([], dtype=dtype).element_size()
        return 2 * cfg.n_layers * block_size * cfg.n_kv_heads * per_head

    @property
    def nbytes(self) -> int:
        scales = 2 * self.k_scale.numel() * self.k_scale.element_size() if self.quantized else 0
        return 2 * self.k.numel() * self.k.element_size() + scales

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write pairs (src, dst) from BlockManager.append_slots, for every layer at once."""
        caches = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        copy_blocks(caches, copies, block_dim=1)                        # (L, num_blocks, ...) each

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v (N, Hkv, D) into their slots (N,), all real: a row scatter (quantised first for int8/fp8)."""
        store_kv_reference(k, v, self.k[layer], self.v[layer], slot_mapping, *self._scales(layer),
                           skip_padding=False)

    def gather(self, layer: int, block_tables: torch.Tensor, out: tuple | None = None):
        """Whole blocks of (B, n) block tables -> K, V (B, n * block_size, Hkv, D) in the compute
        dtype (paged_attention.gather_kv; past each length: stale, mask it). out: two buffers to reuse."""
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
# drafts: 1 + speculative.MAX_SPECULATIVE_TOKENS) join the decode groups on CPU instead of running
# attention one request at a time like a prefill chunk.
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
    decode_tables: torch.Tensor    # (Bd, max_blocks) int32 block tables, for the GPU kernel
    decode_lens: torch.Tensor      # (Bd,) int32 keys per decode row, for the GPU kernel
    decode_groups: list            # [DecodeGroup], for the CPU path
    prefills: list                 # [(row_start, T, start, block_table (1, n) int32, mask (T, start+T) or None)]
    grouped_runs: list             # [(row_start, T, start, block table)] runs of T > 1 inside decode_groups


def build_batch(runs: list[tuple[list[int], int, list[int], list[int]]], want_logits: list[str],
                block_size: int, device, group_cost: int | None = GROUP_COST_BLOCKS) -> PagedBatch:
    """runs: per request (new token ids, start position, block table, slots of the new tokens).
    want_logits per run: "last" (the last row), "all" (every row) or "none".
    group_cost None: no decode groups (the GPU kernel handles every length in one launch)."""
    tokens, positions, slots, logits_rows = [], [], [], []
    dec_rows, dec_lens, dec_tables, prefills = [], [], [], []
    short = []                                       # (row, T, start, table): runs for the CPU groups
    row = 0
    for (new, start, table, new_slots), want in zip(runs, want_logits):
        T = len(new)
        tokens += new
        positions += range(start, start + T)
        slots += new_slots
        if want == "all":
            logits_rows += range(row, row + T)
        elif want == "last":
            logits_rows.append(row + T - 1)
        table = table[:math.ceil((start + T) / block_size)]
        if T == 1:
            dec_rows.append(row)
            dec_lens.append(start + 1)
            dec_tables.append(table)
        if group_cost is not None and (T == 1 or (start > 0 and T <= MAX_GROUPED_QUERIES)):
            short.append((row, T, start, table))     # NEW: speculative, verified with the decodes
        elif T > 1:
            mask = causal_mask(T, start + T, device) if start else None        # (T, start+T) or causal
            prefills.append((row, T, start, block_table_tensor([table], device), mask))   # (1, n) table
        row += T
    groups = []
    if short:
        for members in group_by_length([len(short[i][3]) for i in range(len(short))], group_cost):
            groups.append(_decode_group([short[i] for i in members], block_size, device))
    as_long = dict(dtype=torch.long, device=device)
    return PagedBatch(torch.tensor(tokens, **as_long), torch.tensor(positions, **as_long),
                      torch.tensor(slots, **as_long), torch.tensor(logits_rows, **as_long),
                      torch.tensor(dec_rows, **as_long), block_table_tensor(dec_tables, device),
                      torch.tensor(dec_lens, dtype=torch.int32, device=device), groups, prefills,
                      [r for r in short if r[1] > 1])


def _decode_group(members: list[tuple[int, int, int, list[int]]], block_size: int, device) -> DecodeGroup:
    """members: (row, T, start, block table) of each request. Query t of a request sees its keys
    0..start + t (causal within its own new tokens); padded query rows see key 0 only."""
    Tq = max(T for _, T, _, _ in members)
    tables = block_table_tensor([table for _, _, _, table in members]).long()   # (Bg, n)
    t = torch.arange(Tq)                                                          # (Tq,)
    lengths = torch.tensor([T for _, T, _, _ in members])                         # (Bg,)
    starts = torch.tensor([start for _, _, start, _ in members])                  # (Bg,)
    first = torch.tensor([row for row, _, _, _ in members])                       # (Bg,)
    real = t[None, :] < lengths[:, None]                                          # (Bg, Tq)
    rows = first[:, None] + torch.minimum(t[None, :], lengths[:, None] - 1)       # (Bg, Tq)
    keys = torch.arange(tables.shape[1] * block_size)                             # (n * bs,)
    visible = starts[:, None] + torch.where(real, t[None, :], 0)                  # (Bg, Tq) last key seen
    mask = keys[None, None, :] <= visible[:, :, None]                             # (Bg, Tq, n * bs)
    return DecodeGroup(rows.to(device), real.to(device), tables.to(device), mask[:, None].to(device),
                       (starts + lengths).to(device))


def sdpa(q, keys, values, attn_mask=None, is_causal=False):
    """F.scaled_dot_product_attention(q, keys, values, ...) with GQA, (B, H, T, D) layouts; on CPU a
    bf16/fp16 q, K, V are converted to fp32 first and the result back (NEW: the 2-byte CPU kernel is
    slower than those copies plus the fp32 one)."""
    if q.device.type != "cpu" or q.element_size() != 2:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                              enable_gqa=True)
    out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=attn_mask,
                                         is_causal=is_causal, enable_gqa=True)
    return out.to(q.dtype)


_compiled_decode_attention = torch.compile(decode_attention_fused)


def fused_decode_attention(q, k_cache, v_cache, block_tables, seq_lens):
    """decode_attention_fused compiled once per head layout, block size and dtype: the rows, the blocks
    per row and the pool size are marked symbolic from the first call, while the head counts, head
    size and block size stay constants of the generated loops (all-symbolic code, dynamic=True or a
    symbolic block size, ran several times slower here). Rows and blocks per row are padded to at
    least 2 (a repeated row, a repeated block past seq_lens): torch specialises a size of 1, which
    would cost a graph of its own. Where compiling fails, the same contract by gather + SDPA."""
    B, n = block_tables.shape
    if B == 1:
        q, block_tables, seq_lens = torch.cat([q, q]), torch.cat([block_tables, block_tables]), seq_lens.repeat(2)
    if n == 1:
        block_tables = block_tables.repeat(1, 2)                           # the copy is past seq_lens: masked
    for t, dims in ((q, (0,)), (block_tables, (0, 1)), (seq_lens, (0,)), (k_cache, (0,)), (v_cache, (0,))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    out = fast_decode._run_compiled(_compiled_decode_attention, _decode_attention_gathered,
                                    q, k_cache, v_cache, block_tables, seq_lens)      # (B', Hq, D)
    return out[:B]


def _decode_attention_gathered(q, k_cache, v_cache, block_tables, seq_lens):
    """decode_attention_fused's contract by gather + SDPA: what runs where compiling fails."""
    keys, values = gather_kv(k_cache, v_cache, block_tables, dtype=q.dtype)   # (B, L, Hkv, D)
    visible = torch.arange(keys.shape[1], device=q.device) < seq_lens[:, None]  # (B, L)
    out = sdpa(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None])
    return out[:, :, 0]                                                          # (B, Hq, D)


class ModelRunner:
    """Runs PagedBatches of one model over one PagedKVCache."""

    def __init__(self, model: Llama, kv: PagedKVCache, rope: RopeTable, prepack_rows: int | None = None,
                 triton_on_cpu: bool = False, tune_kernels: bool = True):
        """prepack_rows: on CPU, lay the float weights out once for batches of about this many rows
        (minillm/prepacked.py; the engine passes max_num_seqs); None: plain F.linear.
        tune_kernels: time MKL against oneDNN per weight shape, once, here (prepacked.choose_libraries);
        False: the recorded default. What was chosen is kept in self.gemm_libraries.
        triton_on_cpu: run the GPU path (Triton store + paged decode kernel) on CPU tensors under
        TRITON_INTERPRET=1, so that tests on a CPU machine cover what a GPU runs."""
        self.model, self.kv, self.rope = model, kv, rope
        self.fused = is_fused(model)            # fused QKV / gate-up (not for quantised models)
        self.gemm_libraries: dict[str, str] = {}                        # library_key -> "mkl" | "onednn"
        self.packed_layers, self.packed_head = self._prepack(prepack_rows, tune_kernels)
        if triton_on_cpu and kv.k.device.type == "cpu" and not INTERPRETED:
            raise ValueError("triton_on_cpu=True needs TRITON_INTERPRET=1 in the environment before minillm "
                             "is imported (the Triton kernels run on CPU only in the interpreter)")
        # the Triton kernels read the model's dtype from the blocks; an int8/fp8 cache takes the gather path
        self.use_triton = (kv.k.device.type == "cuda" or triton_on_cpu) and not kv.quantized
        self.graphs = None                      # NEW: CUDA graphs; a cuda_graphs.DecodeGraphs set by the engine
        self._buffers = [torch.empty(0, dtype=kv.k.dtype, device=kv.k.device) for _ in range(2)]
        # NEW: fused decode attention, on CPU for a cache in the model's dtype
        self.fused_decode_attention = kv.k.device.type == "cpu" and not self.use_triton and not kv.quantized
        self.fused_attention_calls = 0          # tests prove the path ran

    def drop_prepacked(self) -> None:
        """Run on plain F.linear from now on (frees the packed copies; bench engine-step compares)."""
        self.packed_layers, self.packed_head = None, None

    def _prepack(self, rows: int | None, tune: bool) -> tuple[list | None, prepacked.PrepackedLinear | None]:
        """-> per layer (wqkv, wo, w_gate_up, w_down) prepacked, and the tied LM head; or Nones."""
        model = self.model
        if rows is None or not self.fused or self.kv.k.device.type != "cpu":
            return None, None
        linears = [(layer.attn.wqkv, layer.attn.wo, layer.ffn.w_gate_up, layer.ffn.w_down) for layer in model.layers]
        weights = [m.weight for ms in linears for m in ms if type(m) is torch.nn.Linear and m.bias is None]
        head = model.embed.weight if model.lm_head is None else None
        self.gemm_libraries = prepacked.choose_libraries(weights + ([head] if head is not None else []), rows, tune)
        layers = [tuple(prepacked.prepack_or_none(m, rows, self.gemm_libraries) for m in ms) for ms in linears]
        return layers, None if head is None else prepacked.prepack_or_none(head, rows, self.gemm_libraries)

    def _decode_buffers(self, batch: PagedBatch) -> tuple | None:
        """Two (Bg * n, block_size, Hkv, D) buffers, for the largest decode group, that every
        layer's K/V copy reuses. They only grow, so after the first steps there is no allocation
        (and no page faults) per layer: a fresh 10 MB tensor per layer cost as much as the copy."""
        if self.kv.quantized or self.use_triton or not batch.decode_groups:
            return None                                                  # dequantising allocates anyway
        if self._fused_ready() and all(g.rows.shape[1] == 1 for g in batch.decode_groups):
            return None                                                  # the fused kernel gathers nothing
        shape = (max(g.tables.numel() for g in batch.decode_groups), *self.kv.k.shape[2:])
        n = math.prod(shape)
        for i, buf in enumerate(self._buffers):
            if buf.numel() < n:
                self._buffers[i] = torch.empty(n, dtype=buf.dtype, device=buf.device)
        return tuple(buf[:n].view(shape) for buf in self._buffers)

    def _fused_ready(self) -> bool:
        """Decode groups of single queries take the fused kernel (compiling has not failed here)."""
        return self.fused_decode_attention and fast_decode._compiler_broken is None

    @property
    def graph_replays(self) -> int:
        """How many steps replayed a CUDA graph (0 without graphs): tests prove the graph path ran."""
        return 0 if self.graphs is None else self.graphs.replays

    @torch.no_grad()
    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """-> logits (K, V) of batch.logits_rows."""
        if self.graphs is not None and self.graphs.fits(batch):         # NEW: CUDA graphs, decode-only steps
            return self.graphs.run(batch)
        return self.forward_eager(batch)

    @torch.no_grad()
    def forward_eager(self, batch: PagedBatch) -> torch.Tensor:
        """-> logits (K, V) of batch.logits_rows, op by op (a CUDA graph records this)."""
        h = self.forward_layers(self.model.embed(batch.tokens), batch)   # (N, dim)
        if self.packed_head is not None:                                 # NEW: prepacked
            return prepacked.lm_head(self.packed_head, self.model, h[batch.logits_rows])
        return lm_head(self.model, h[batch.logits_rows])                 # (K, V)

    @torch.no_grad()
    def forward_layers(self, h: torch.Tensor, batch: PagedBatch) -> torch.Tensor:
        """h (N, dim) through every layer of self.model (a pipeline stage runs only its own)."""
        model, cfg = self.model, self.model.cfg
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        N = batch.tokens.shape[0]
        rotation = self.rope.rotation[batch.positions][:, None]          # (N, 1, D/2) complex
        buffers = self._decode_buffers(batch)
        for i, layer in enumerate(model.layers):
            pqkv, pwo, pgate_up, pdown = self.packed_layers[i] if self.packed_layers else (None,) * 4
            q, k, v = self._qkv(layer.attn, rms_norm(layer.attn_norm, h), rotation, pqkv)   # (N, H, D) each, q k rotated
            self._store(i, k, v, batch.slot_mapping)                     # NEW: paged
            out = self._attention(i, q, batch, buffers)                  # (N, Hq, D)
            h = h + self._linear(pwo, layer.attn.wo, out.reshape(N, Hq * D))
            x = rms_norm(layer.ffn_norm, h)
            if self.fused:
                gate, up = self._linear(pgate_up, layer.ffn.w_gate_up, x).chunk(2, dim=-1)   # (N, ffn) each
                h = h + self._linear(pdown, layer.ffn.w_down, F.silu(gate) * up)
            else:
                h = h + layer.ffn(x)
        return h

    @staticmethod
    def _linear(packed, module, x):
        """x (N, in) -> (N, out): the prepacked weight where there is one (NEW: prepacked)."""
        return linear(module, x) if packed is None else packed(x)

    def _qkv(self, attn, x, rotation, packed=None):
        """-> q (N, Hq, D), k (N, Hkv, D) with RoPE applied, v (N, Hkv, D)."""
        cfg = self.model.cfg
        Hq, Hkv, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        if self.fused:                                   # rotate q and k in one go
            qk, v = self._linear(packed, attn.wqkv, x).split([(Hq + Hkv) * D, Hkv * D], dim=-1)
            qk = apply_rope_complex(qk.view(-1, Hq + Hkv, D), rotation)   # (N, Hq+Hkv, D)
            return qk[:, :Hq], qk[:, Hq:], v.view(-1, Hkv, D)
        q, k, v = attn.wq(x), attn.wk(x), attn.wv(x)
        return (apply_rope_complex(q.view(-1, Hq, D), rotation), apply_rope_complex(k.view(-1, Hkv, D), rotation),
                v.view(-1, Hkv, D))

    def _store(self, layer: int, k, v, slot_mapping) -> None:
        if self.use_triton:
            from kernels.paged_attention import store_kv
            store_kv(k, v, self.kv.k[layer], self.kv.v[layer], slot_mapping, slots_checked=True)   # block manager's slots
        else:
            self.kv.store(layer, k, v, slot_mapping)

    def _attention(self, layer: int, q, batch: PagedBatch, buffers=None):
        """q (N, Hq, D) -> (N, Hq, D); each row attends to its own request's keys only."""
        k_cache, v_cache = self.kv.k[layer], self.kv.v[layer]            # (blocks, bs, Hkv, D)
        only_decodes = not batch.prefills                                # every row is in decode_groups (CPU)
        out = None if only_decodes else torch.empty_like(q)
        if self.use_triton and batch.decode_rows.numel():
            from kernels.paged_attention import paged_attention_decode
            qd = q if only_decodes else q[batch.decode_rows]              # (Bd, Hq, D)
            od = paged_attention_decode(qd, k_cache, v_cache, batch.decode_tables, batch.decode_lens)
            if only_decodes:                                              # rows are 0..N-1 in order
                return od
            out[batch.decode_rows] = od
        elif batch.decode_groups:                                         # CPU
            in_order = only_decodes and len(batch.decode_groups) == 1 and not batch.grouped_runs
            fused = self._fused_ready()
            for g in batch.decode_groups:
                if fused and g.rows.shape[1] == 1:                        # NEW: fused decode attention
                    qd = (q if in_order else q[g.rows[:, 0]]).contiguous()   # (Bg, Hq, D): one layout, one graph
                    od = fused_decode_attention(qd, k_cache, v_cache, g.tables, g.seq_lens)   # (Bg, Hq, D)
                    self.fused_attention_calls += 1
                    if in_order:
                        return od
                    if out is None:
                        out = torch.empty_like(q)
                    out[g.rows[:, 0]] = od
                    continue
                # copy blocks, then SDPA
                qd = q[:, None] if in_order else q[g.rows]                # (Bg, Tq, Hq, D)
                reuse = None if buffers is None else tuple(b[:g.tables.numel()] for b in buffers)
                keys, values = self.kv.gather(layer, g.tables, reuse)    # (Bg, n * bs, Hkv, D)
                od = sdpa(qd.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                          attn_mask=g.mask)                               # (Bg, Hq, Tq, D)
                od = od.transpose(1, 2)                                   # (Bg, Tq, Hq, D)
                if in_order:                                              # rows are 0..N-1, one each
                    return od[:, 0]
                if out is None:
                    out = torch.empty_like(q)
                out[g.rows[g.real]] = od[g.real]
        for row, T, start, blocks, mask in batch.prefills:
            qp = q[row:row + T].transpose(0, 1)[None]                     # (1, Hq, T, D)
            keys, values = self.kv.gather(layer, blocks)                  # (1, L_pad, Hkv, D)
            keys = keys[:, :start + T].transpose(1, 2)                    # (1, Hkv, L, D)
            values = values[:, :start + T].transpose(1, 2)
            op = sdpa(qp, keys, values, attn_mask=mask, is_causal=mask is None)   # (1, Hq, T, D)
            out[row:row + T] = op[0].transpose(0, 1)
        return out
