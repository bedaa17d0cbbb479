"""The engine's attention backends: one interface, chosen once when the engine is built.

    backend = make_backend(kv, prefill="sdpa", triton=False, run_compiled=runner._run)
    out = backend.forward(layer, q, k, v, batch)     # q (N, Hq, D), k v (N, Hkv, D) -> (N, Hq, D)

forward stores the rows' k and v in the paged cache (minillm/model/runner.py's PagedKVCache) at
batch.slot_mapping, then gives every row attention over its own request's keys only. What a
backend reads from the step's metadata (runner.PagedBatch, built once per step and shared by
every layer): the decode rows with their block tables and lengths, the CPU decode groups, and the
runs of more tokens (a prefill chunk) as Run records.

    "torch"      the reference: each group's or run's blocks gathered (attention.paged.gather_kv),
                 then torch's SDPA with a padding mask; also the path of an int8/fp8 cache (its
                 gather dequantises)
    "cpu-fused"  decode rows read their blocks in place by a compiled loop
                 (attention.paged.decode_attention_fused): no gathered copy, no fp32 copy
    "cpu"        what a CPU runs where a C compiler is found: every decode row in one call of a
                 hand-written C kernel (attention/cpu_decode.c), each row's blocks read once for all the
                 query heads of a KV head and only up to its own length (NEW: no groups by length)
    "triton"     what a GPU runs: the Triton store and paged decode kernel (kernels/paged_attention.py),
                 every decode row in one launch

A prefill run attends by the function of the LLM's attention_backend option (model.llama.attention_function:
"naive", "sdpa" or "flash", FlashAttention of lesson 05) in every backend.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minillm.model.layer import compile_on_first_call
from minillm.model.llama import attention_function, sdpa_attention
from .paged import decode_attention_fused, gather_kv

BACKENDS = ("torch", "cpu-fused", "cpu", "triton")


@dataclass
class Run:
    """One request's new tokens inside the step's flat batch: rows row .. row + length - 1, which
    continue the request at position start; table: its block table; blocks: the same as a (1, n)
    int32 tensor, for a prefill run."""
    row: int
    length: int
    start: int
    table: list[int]
    blocks: torch.Tensor | None = None


def sdpa(q, keys, values, attn_mask=None, is_causal=False):
    """F.scaled_dot_product_attention(q, keys, values, ...) with GQA, (B, H, T, D) layouts; on CPU a
    bf16/fp16 q, K, V are converted to fp32 first and the result back (the 2-byte CPU kernel is
    slower than those copies plus the fp32 one: bench engine-step measures both)."""
    if q.device.type != "cpu" or q.element_size() != 2:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, is_causal=is_causal,
                                              enable_gqa=True)
    out = F.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=attn_mask,
                                         is_causal=is_causal, enable_gqa=True)
    return out.to(q.dtype)


def sdpa_prefill(q, keys, values, causal: bool = True, window: int | None = None):
    """model.llama.sdpa_attention (causal with an offset after cached keys) by way of `sdpa` above."""
    if q.device.type != "cpu" or q.element_size() != 2:
        return sdpa_attention(q, keys, values, causal, window)
    return sdpa_attention(q.float(), keys.float(), values.float(), causal, window).to(q.dtype)


# dynamic=False: only the sizes marked below are symbolic. Dynamo remembers sizes per function, not per
# model, so under its default a second model in the process (a draft, a test's next tiny model) would
# turn the head counts, head size and block size symbolic too (as layer.compiled_decode_layer explains).
_compiled_decode_attention = compile_on_first_call(decode_attention_fused, dynamic=False)


def fused_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window=None):
    """decode_attention_fused compiled once per head layout, block size and dtype: the rows, the blocks
    per row and the pool size are marked symbolic from the first call, while the head counts, head
    size and block size stay constants of the generated loops (all-symbolic code, dynamic=True or a
    symbolic block size, ran several times slower here). Rows and blocks per row are padded to at
    least 2 (a repeated row, a repeated block past seq_lens): torch specialises a size of 1, which
    would cost a graph of its own. The backend falls back to decode_attention_gathered (the same
    contract by gather + SDPA) where compiling fails."""
    B, n = block_tables.shape
    if B == 1:
        q, block_tables, seq_lens = torch.cat([q, q]), torch.cat([block_tables, block_tables]), seq_lens.repeat(2)
    if n == 1:
        block_tables = block_tables.repeat(1, 2)                           # the copy is past seq_lens: masked
    for t, dims in ((q, (0,)), (block_tables, (0, 1)), (seq_lens, (0,)), (k_cache, (0,)), (v_cache, (0,))):
        for d in dims:
            torch._dynamo.maybe_mark_dynamic(t, d)
    return _compiled_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, window)[:B]   # (B, Hq, D)


def decode_attention_gathered(q, k_cache, v_cache, block_tables, seq_lens, window=None):
    """decode_attention_fused's contract by gather + SDPA: what runs where compiling fails."""
    keys, values = gather_kv(k_cache, v_cache, block_tables, dtype=q.dtype)   # (B, L, Hkv, D)
    key_pos = torch.arange(keys.shape[1], device=q.device)
    visible = key_pos < seq_lens[:, None]                                        # (B, L)
    if window is not None:
        visible &= key_pos >= seq_lens[:, None] - window
    out = sdpa(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=visible[:, None, None])
    return out[:, :, 0]                                                          # (B, Hq, D)


class TorchBackend:
    """Gather, then SDPA: the reference every other backend is tested against."""
    name = "torch"
    groups_decodes = True                       # decode rows come in groups by length (runner.group_by_length)

    def __init__(self, kv, prefill: str = "sdpa", run_compiled=None, window: int | None = None):
        """kv: the PagedKVCache; prefill: the attention function of prefill runs (model.ATTENTION_BACKENDS);
        run_compiled(compiled, eager, *args): how a compiled kernel is called (the runner's, which
        falls back to eager where torch.compile cannot build); window: the model's sliding window
        (each row sees its last `window` keys; the decode groups' masks carry it, runner.build_batch)."""
        self.kv, self.window = kv, window
        self.prefill_attention = sdpa_prefill if prefill == "sdpa" else attention_function(prefill)
        self.run_compiled = run_compiled or (lambda compiled, eager, *args: compiled(*args))
        # K and V each a buffer; a latent (MLA) cache gathers its keys only (its values are a view of them)
        self._buffers = [torch.empty(0, dtype=kv.k.dtype, device=kv.k.device) for _ in range(1 if kv.latent else 2)]
        self.buffers = None                     # this step's reused gather buffers (begin_step)

    def begin_step(self, batch) -> None:
        """Before the first layer of a step: buffers for the step's largest decode group."""
        self.buffers = self._decode_buffers(batch)

    def forward(self, layer: int, q, k, v, batch):
        """Store the rows' k, v, then q (N, Hq, D) -> (N, Hq, D), each row over its own request's keys."""
        self.store(layer, k, v, batch.slot_mapping)
        out = self.attend_decodes(layer, q, batch)
        return out if not batch.prefills else self.attend_prefills(layer, q, batch, out)

    def forward_outside_graph(self, layer: int, batch, q, k, v):
        """forward, for the runner's compiled batched step, which calls it through torch.compiler.disable
        (Dynamo then compiles the layer's pieces around the call, layer.compiled_layer). The output's rows
        are marked symbolic for the piece after it: the row count is the one size that changes between steps."""
        out = self.forward(layer, q, k, v, batch)
        torch._dynamo.mark_dynamic(out, 0)
        return out

    def store(self, layer: int, k, v, slot_mapping) -> None:
        self.kv.store(layer, k, v, slot_mapping)

    def attend_decodes(self, layer: int, q, batch):
        """The decode groups (CPU): -> (N, Hq, D), the other rows unwritten; or None without groups."""
        if not batch.decode_groups:
            return None
        only_decodes = not batch.prefills
        in_order = only_decodes and len(batch.decode_groups) == 1 and not batch.grouped_runs
        out = None
        for g in batch.decode_groups:
            od = self.attend_group(layer, q, g, in_order)
            if in_order:                                                  # rows are 0..N-1, one each
                return od
            if out is None:
                out = self.output_like(q)
            if od.dim() == 3:                                             # (Bg, Hq, D): one query per request
                out[g.rows[:, 0]] = od
            else:                                                         # (Bg, Tq, Hq, D)
                out[g.rows[g.real]] = od[g.real]
        return out

    def attend_group(self, layer: int, q, g, in_order: bool):
        """One decode group by gather + SDPA -> (Bg, Tq, Hq, D), or (Bg, Hq, D) when in_order."""
        qd = q[:, None] if in_order else q[g.rows]                        # (Bg, Tq, Hq, D)
        reuse = None if self.buffers is None else tuple(b[:g.tables.numel()] for b in self.buffers)
        keys, values = self.kv.gather(layer, g.tables, reuse)            # (Bg, n * bs, Hkv, D)
        od = sdpa(qd.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=g.mask)
        od = od.transpose(1, 2)                                           # (Bg, Tq, Hq, D)
        return od[:, 0] if in_order else od

    def attend_prefills(self, layer: int, q, batch, out):
        """Every prefill run attends causally to its cached keys and its own; -> out (N, Hq, D)."""
        if out is None:
            out = self.output_like(q)
        for run in batch.prefills:
            rows = slice(run.row, run.row + run.length)
            qp = q[rows].transpose(0, 1)[None]                            # (1, Hq, T, D)
            keys, values = self.kv.gather(layer, run.blocks)              # (1, L_pad, Hkv, D)
            keys = keys[:, :run.start + run.length].transpose(1, 2)       # (1, Hkv, L, D)
            values = values[:, :run.start + run.length].transpose(1, 2)
            out[rows] = self.prefill_attention(qp, keys, values, causal=True, window=self.window)[0].transpose(0, 1)
        return out

    def output_like(self, q):
        """An empty output (N, Hq, value width) for q (N, Hq, D): the values are narrower than the keys in a
        latent (MLA) cache."""
        return q.new_empty(*q.shape[:-1], self.kv.value_dim)

    def _decode_buffers(self, batch) -> tuple | None:
        """Two (one for a latent cache) (Bg * n, block_size, Hkv, D) buffers, for the largest gathered decode group, that every
        layer's K/V copy reuses. They only grow, so after the first steps there is no allocation
        (and no page faults) per layer: a fresh 10 MB tensor per layer cost as much as the copy."""
        groups = [g for g in batch.decode_groups if self.gathers(g)]
        if self.kv.quantized or not groups:
            return None                                                  # dequantising allocates anyway
        shape = (max(g.tables.numel() for g in groups), *self.kv.k.shape[2:])
        n = math.prod(shape)
        for i, buf in enumerate(self._buffers):
            if buf.numel() < n:
                self._buffers[i] = torch.empty(n, dtype=buf.dtype, device=buf.device)
        return tuple(buf[:n].view(shape) for buf in self._buffers)

    def gathers(self, group) -> bool:
        """This group's keys are copied out of the cache (and need the buffers)."""
        return True


class CpuFusedBackend(TorchBackend):
    """Decode groups of one query per request by the compiled in-place kernel; the rest as TorchBackend."""
    name = "cpu-fused"

    def __init__(self, kv, prefill: str = "sdpa", run_compiled=None, window: int | None = None):
        super().__init__(kv, prefill, run_compiled, window)
        self.fused_calls = 0                    # tests prove the path ran

    def gathers(self, group) -> bool:
        return group.rows.shape[1] > 1

    def attend_group(self, layer: int, q, g, in_order: bool):
        if self.gathers(g):                                               # speculative runs: gather + SDPA
            return super().attend_group(layer, q, g, in_order)
        qd = (q if in_order else q[g.rows[:, 0]]).contiguous()           # (Bg, Hq, D): one layout, one graph
        self.fused_calls += 1
        return self.run_compiled(fused_decode_attention, decode_attention_gathered,
                                 qd, self.kv.k[layer], self.kv.v[layer], g.tables, g.seq_lens, self.window)   # (Bg, Hq, D)


class AllDecodesBackend(TorchBackend):
    """Every decode row in one kernel call (self.decode), each row over its own blocks and length, so no
    groups by length; prefill runs (and speculative runs of several tokens) attend as in TorchBackend."""
    groups_decodes = False

    def attend_decodes(self, layer: int, q, batch):
        if not batch.decode_rows.numel():
            return None
        only_decodes = not batch.prefills                                 # rows are 0..N-1 in order
        qd = q if only_decodes else q[batch.decode_rows]                  # (Bd, Hq, D)
        od = self.decode(qd, self.kv.k[layer], self.kv.v[layer], batch.decode_tables, batch.decode_lens)
        if only_decodes:
            return od
        out = self.output_like(q)
        out[batch.decode_rows] = od
        return out


class CpuKernelBackend(AllDecodesBackend):
    """Decode rows by the C kernel of attention/cpu_decode.c; the rest as TorchBackend."""
    name = "cpu"

    def decode(self, q, k_cache, v_cache, tables, lens):
        from .cpu_decode import decode_attention_op
        return decode_attention_op(q, k_cache, v_cache, tables, lens, self.window)   # (Bd, Hq, D)


class TritonBackend(AllDecodesBackend):
    """The Triton store and paged decode kernel for every decode row; prefill runs as TorchBackend."""
    name = "triton"

    def store(self, layer: int, k, v, slot_mapping) -> None:
        from kernels.paged_attention import store_kv
        store_kv(k, v, self.kv.k[layer], self.kv.v[layer], slot_mapping, slots_checked=True)   # the block manager's

    def decode(self, q, k_cache, v_cache, tables, lens):
        from kernels.paged_attention import paged_attention_decode
        return paged_attention_decode(q, k_cache, v_cache, tables, lens)


def choose_backend(kv, triton: bool, n_heads: int) -> str:
    """The backend for this cache and device: the Triton kernels on a GPU (or forced on CPU, under the
    interpreter) for a cache in the model's dtype; on CPU the C kernel where it builds and takes this head
    layout (n_heads query heads), else the compiled PyTorch kernel; an int8/fp8 cache: torch."""
    if kv.quantized:
        return "torch"
    if kv.latent:                                   # values narrower than keys: the kernels that index v as k do not apply
        return "cpu-fused" if kv.k.device.type == "cpu" and not triton else "torch"
    if triton or kv.k.device.type == "cuda":
        return "triton"
    from . import cpu_decode
    return "cpu" if cpu_decode.usable(n_heads, kv.k) else "cpu-fused"


def make_backend(name: str, kv, prefill: str = "sdpa", run_compiled=None, window: int | None = None) -> TorchBackend:
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is not supported; allowed: {', '.join(map(repr, BACKENDS))}")
    if name == "triton" and window is not None:
        raise ValueError("the 'triton' paged decode kernel has no sliding window; a windowed model (Mistral) "
                         "runs on the CPU backends ('cpu-fused', 'torch')")
    if name in ("triton", "cpu") and kv.latent:
        raise ValueError(f"the {name!r} attention backend reads values as wide as keys; a latent (MLA) cache runs on "
                         "'torch' or 'cpu-fused'")
    if name == "triton" and kv.quantized:
        raise ValueError("the 'triton' attention backend reads the cache in the model's dtype; an int8/fp8 "
                         "KV cache needs 'torch' (its gather dequantises)")
    if name == "cpu":
        from . import cpu_decode
        if kv.quantized or not cpu_decode.supports(kv.k.shape[-2], kv.k):
            raise ValueError("the 'cpu' attention backend reads a CPU cache in fp32 or bf16 with a head size that is a "
                             "multiple of 16; an int8/fp8 KV cache needs 'torch', a GPU 'triton', others 'cpu-fused'")
        lib, why = cpu_decode.kernel()
        if lib is None:
            raise ValueError(f"the 'cpu' attention backend's C kernel is not available here ({why}); "
                             "'cpu-fused' runs without it")
    cls = {"torch": TorchBackend, "cpu-fused": CpuFusedBackend, "cpu": CpuKernelBackend, "triton": TritonBackend}[name]
    return cls(kv, prefill, run_compiled, window)
