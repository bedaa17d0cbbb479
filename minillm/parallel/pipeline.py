"""Pipeline parallelism: contiguous layers per rank, activations passed to the next rank.

Rank s of p holds layers stage_bounds(n_layers, p)[s]; a forward pass is a relay:

    rank 0: embed -> layers 0..a  --send h-->  rank 1: layers ..b  --send h--> ... rank p-1: layers
            .. n -> norm -> LM head --send logits--> rank 0 (the driver samples)

One batch alone would keep one rank busy at a time. GPipe (Huang et al. 2019) cuts the batch
into m micro-batches: while rank 1 runs micro-batch 1, rank 0 already runs micro-batch 2. With p
stages of equal time t per micro-batch the whole pass takes (m + p - 1) t, of which each rank is
busy m t: the idle share, the bubble, is (p - 1) / (m + p - 1) (minillm/course/calculators.py: bubble_fraction). Communication
is one (tokens, dim) activation per stage boundary per token: far less than tensor parallelism's
two all-reduces per layer, which is why PP is what crosses slow links between nodes.

Here every stage keeps the (tied) embedding and the final norm: stage 0 embeds, the last stage
applies norm + LM head; with tied weights both need the same matrix anyway.
"""
from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from minillm.model.llama import Llama
from minillm.model.positions import rope_cos_sin
from minillm.model.runner import PagedBatch, build_batch
from .comm import recv, send


def gpipe_schedule(p: int, m: int) -> list[tuple[int, int, int]]:
    """(stage, micro-batch, time slot) of a GPipe forward with one time unit per stage and
    micro-batch: micro-batch j can enter stage s only after stage s - 1 is done with it and stage
    s is done with j - 1, so at slot s + j. The pass lasts m + p - 1 slots; each stage works m."""
    return [(s, j, s + j) for s in range(p) for j in range(m)]


def check_pp_size(n_layers: int, size) -> int:
    if not isinstance(size, int) or not 1 <= size <= n_layers:
        raise ValueError(f"pipeline_parallel_size = {size!r} is invalid; allowed: an integer from 1 to the "
                         f"model's {n_layers} layers (each stage needs at least one layer)")
    return size


def stage_bounds(n_layers: int, p: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) layer ranges, the first n_layers % p stages one layer longer."""
    base, extra = divmod(n_layers, p)
    bounds, start = [], 0
    for s in range(p):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


def stage_model(model: Llama, rank: int, size: int) -> Llama:
    """A Llama holding only rank's layers (shared with model, not copied) plus embedding and norm."""
    check_pp_size(model.cfg.n_layers, size)
    start, end = stage_bounds(model.cfg.n_layers, size)[rank]
    with torch.device("meta"):
        stage = Llama(replace(model.cfg, n_layers=end - start))
    stage.embed, stage.norm, stage.lm_head = model.embed, model.norm, model.lm_head
    stage.layers = torch.nn.ModuleList(model.layers[start:end])
    stage.pp_rank, stage.pp_size, stage.first_layer = rank, size, start
    return stage.eval()


# --- the plain model (no cache): GPipe over the batch dimension -----------------------------

@torch.no_grad()
def pipeline_forward(stage: Llama, tokens: torch.Tensor, num_micro: int, timing: dict | None = None):
    """Llama.forward (naive attention) of tokens (B, T), run by every rank on its stage with the
    batch cut into num_micro micro-batches. Returns logits (B, T, V) on rank 0, None elsewhere.
    timing, if given, gets "busy" (seconds computing) and "wall" (first start to last end)."""
    rank, p = stage.pp_rank, stage.pp_size
    B, T = tokens.shape
    cos, sin = rope_cos_sin(torch.arange(T), stage.cfg.head_dim, stage.cfg.rope_theta, stage.cfg.rope_scaling)   # (T, hd/2)
    dtype, dim = stage.embed.weight.dtype, stage.cfg.dim
    sends, busy, t0 = [], 0.0, time.perf_counter()
    for mb in tokens.tensor_split(num_micro):                     # (b, T) each
        h = stage.embed(mb) if rank == 0 else recv((mb.shape[0], T, dim), dtype, rank - 1)   # (b, T, dim)
        t = time.perf_counter()
        for layer in stage.layers:
            h = layer(h, cos, sin)
        if rank == p - 1:
            h = stage.logits(h)                                   # (b, T, V)
        busy += time.perf_counter() - t
        sends.append(send(h, (rank + 1) % p))                     # the last stage sends logits to rank 0
    out = None
    if rank == 0:
        out = torch.cat([recv((mb.shape[0], T, stage.cfg.vocab_size), dtype, p - 1)
                         for mb in tokens.tensor_split(num_micro)])   # (B, T, V)
    for work in sends:
        work.wait()
    if timing is not None:
        timing.update(busy=busy, wall=time.perf_counter() - t0)
    return out


# --- the paged engine: micro-batches of requests ------------------------------------------

def split_batch(batch: PagedBatch, num_micro: int, block_size: int) -> list[PagedBatch]:
    """Cut a PagedBatch into up to num_micro PagedBatches of whole requests, balanced by tokens,
    in order (so their logits, concatenated, are the batch's). The runs are read back from the batch."""
    runs, wants = _runs_of(batch, block_size)
    total, parts, current, done = len(batch.tokens), [], [], 0
    for run, want in zip(runs, wants):
        current.append((run, want))
        done += len(run[0])
        if done >= total * (len(parts) + 1) / num_micro and len(parts) < num_micro - 1:
            parts.append(current)
            current = []
    if current:
        parts.append(current)
    on_gpu = batch.decode_rows.numel() > 0 and not batch.decode_groups   # the kernel takes all decode rows
    extra = {"group_cost": None} if on_gpu else {}
    return [build_batch([r for r, _ in part], [w for _, w in part], block_size, batch.tokens.device,
                        window=batch.window, **extra) for part in parts]


def _runs_of(batch: PagedBatch, block_size: int):
    """-> the (new tokens, start, block table, slots) runs and "all"/"last"/"none" wants, in row order."""
    wanted = set(batch.logits_rows.tolist())
    starts = {}                                                    # row -> (T, start, table)
    for run in batch.prefills + batch.grouped_runs:                # grouped: short runs attended with the decodes
        starts[run.row] = (run.length, run.start, list(run.table))
    for i, row in enumerate(batch.decode_rows.tolist()):
        keys = int(batch.decode_lens[i])                           # start + 1
        starts[row] = (1, keys - 1, batch.decode_tables[i, :math.ceil(keys / block_size)].tolist())
    tokens, slots = batch.tokens.tolist(), batch.slot_mapping.tolist()
    runs, wants = [], []
    for row in sorted(starts):
        T, start, table = starts[row]
        rows = range(row, row + T)
        hit = sum(r in wanted for r in rows)
        wants.append("all" if hit == T and T > 1 else "last" if row + T - 1 in wanted else "none")
        runs.append((tokens[row:row + T], start, table, slots[row:row + T]))
    return runs, wants


def pipeline_step(runner, micro: list[PagedBatch], rank: int, p: int, timing: dict | None = None):
    """One engine step on rank's stage: every micro-batch through this stage's layers, activations
    sent on; the last stage sends logits to rank 0, which returns them (K, V) concatenated."""
    model = runner.model
    dtype, dim = model.embed.weight.dtype, model.cfg.dim
    sends, busy, t0 = [], 0.0, time.perf_counter()
    for mb in micro:
        N = mb.tokens.shape[0]
        h = model.embed(mb.tokens) if rank == 0 else recv((N, dim), dtype, rank - 1)   # (N, dim)
        t = time.perf_counter()
        h = runner.forward_layers(h, mb)                          # (N, dim)
        if rank == p - 1:
            h = model.logits(h[mb.logits_rows])                  # (K, V)
        busy += time.perf_counter() - t
        if rank < p - 1 or h.shape[0]:                            # no empty logits message
            sends.append(send(h, (rank + 1) % p))
    out = None
    if rank == 0:
        V = model.cfg.vocab_size
        out = torch.cat([recv((len(mb.logits_rows), V), dtype, p - 1) if len(mb.logits_rows)
                         else torch.empty(0, V, dtype=dtype) for mb in micro])     # (K, V)
    for work in sends:
        work.wait()
    if timing is not None:
        timing["busy"] = timing.get("busy", 0.0) + busy
        timing["wall"] = timing.get("wall", 0.0) + time.perf_counter() - t0
    return out
