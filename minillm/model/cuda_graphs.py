"""CUDA graphs for decode steps (vLLM's CUDAGraphRunner): the step's kernels recorded once, replayed.

A decode step of a small model is launch-bound on a GPU: every layer launches ~15 kernels (norms,
matmuls, RoPE, the KV store, the paged kernel) and each launch costs the CPU a few microseconds,
about as long as the GPU needs to run it. A CUDA graph records all of a step's launches once; a
replay sends them to the GPU as one. A replay runs the same kernels on the same addresses with the
same shapes, so:
- the inputs live in static buffers (StaticInputs); a replay first copies the step's tokens,
  positions, slots, block tables and lengths into them;
- the batch is padded to a bucket size: padding rows write no K/V (slot -1) and read one key of
  block 0 (length 1, always a valid address); their logits are dropped;
- only steps whose every row is one decode token take a graph (no prefill chunk, no speculative
  run: their shapes change every step); any other step runs eagerly, op by op.

Buckets (batch_buckets): 1, 2, 4, then every multiple of 8 up to max_num_seqs, vLLM's list. A step
pads at most 7 rows (decode matmuls are bandwidth-bound: 7 more rows cost little), and each bucket
costs one capture (tens of ms, on its first use) plus its activations; all graphs share one memory
pool because they never run at the same time.

On CPU (tests, TRITON_INTERPRET=1, ModelRunner(triton_on_cpu=True)) the same padded forward runs
without being recorded, so CI proves everything except the recording itself.
"""
from __future__ import annotations

import bisect

import torch

from .runner import PagedBatch


def check_enforce_eager(enforce_eager) -> bool:
    """vLLM's switch: True runs every step op by op, False (default) uses CUDA graphs where they apply."""
    if not isinstance(enforce_eager, bool):
        raise ValueError(f"enforce_eager = {enforce_eager!r} is invalid; allowed: True or False "
                         f"(False: CUDA graphs for decode steps when the model runs on CUDA)")
    return enforce_eager


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is recorded for: 1, 2, 4, 8, 16, 24, ... and max_num_seqs last."""
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return small + list(range(8, max_num_seqs, 8)) + [max_num_seqs]


def bucket_for(buckets: list[int], batch_size: int) -> int:
    """The smallest bucket that holds batch_size rows."""
    return buckets[bisect.bisect_left(buckets, batch_size)]


class StaticInputs:
    """A decode step's inputs at fixed addresses, for up to max_batch rows; bucket b reads rows :b."""

    def __init__(self, max_batch: int, max_blocks: int, device):
        as_long = dict(dtype=torch.long, device=device)
        self.tokens = torch.zeros(max_batch, **as_long)                   # (Bmax,)
        self.positions = torch.zeros(max_batch, **as_long)                # (Bmax,)
        self.slots = torch.full((max_batch,), -1, **as_long)              # (Bmax,) -1: writes nothing
        self.rows = torch.arange(max_batch, **as_long)                    # (Bmax,) every row decodes, wants logits
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device)   # (Bmax, max_blocks)
        self.lens = torch.ones(max_batch, dtype=torch.int32, device=device)                  # (Bmax,)

    def pad(self, lo: int, hi: int) -> None:
        """Rows lo:hi become padding: token 0 at position 0, no K/V written, key 0 of block 0 read."""
        self.tokens[lo:hi] = 0
        self.positions[lo:hi] = 0
        self.slots[lo:hi] = -1
        self.tables[lo:hi, 0] = 0
        self.lens[lo:hi] = 1

    def load(self, batch: PagedBatch, bucket: int) -> None:
        """Copy the step's B real rows in; rows B:bucket (real in an earlier, larger step) are padded."""
        B, width = batch.tokens.shape[0], batch.decode_tables.shape[1]
        self.tokens[:B].copy_(batch.tokens)
        self.positions[:B].copy_(batch.positions)
        self.slots[:B].copy_(batch.slot_mapping)
        self.tables[:B, :width].copy_(batch.decode_tables)    # columns past width: stale, never read (pos < len)
        self.lens[:B].copy_(batch.decode_lens)
        self.pad(B, bucket)

    def batch(self, bucket: int) -> PagedBatch:
        """Views of the first `bucket` rows as a PagedBatch of decode rows only."""
        rows = self.rows[:bucket]                                         # (b,)
        return PagedBatch(self.tokens[:bucket], self.positions[:bucket], self.slots[:bucket], rows, rows,
                          self.tables[:bucket], self.lens[:bucket], decode_groups=[], prefills=[], grouped_runs=[])


def run_padded_decode(runner, inputs: StaticInputs, bucket: int) -> torch.Tensor:
    """The forward a graph records: embed -> layers -> LM head for all `bucket` rows of the static
    buffers, ordinary torch code (it runs as is on CPU). -> logits (bucket, V)."""
    return runner.forward_eager(inputs.batch(bucket))


class DecodeGraphs:
    """One CUDA graph per bucket, recorded on the bucket's first use; on CPU, the padded forward unrecorded."""

    def __init__(self, runner, max_num_seqs: int, max_blocks: int):
        self.runner = runner
        self.buckets = batch_buckets(max_num_seqs)
        device = runner.kv.k.device
        self.record = device.type == "cuda"
        self.inputs = StaticInputs(self.buckets[-1], max_blocks, device)
        self.graphs: dict[int, tuple] = {}        # bucket -> (torch.cuda.CUDAGraph, logits (b, V) it writes)
        self.pool = None                          # the memory pool every graph shares (one runs at a time)
        self.replays = 0                          # steps that replayed a graph (CUDA)
        self.padded_steps = 0                     # steps through the padded forward, replayed or not

    def fits(self, batch: PagedBatch) -> bool:
        """Every row is one decode token that wants its logits, and the batch fits the largest bucket."""
        n = batch.tokens.shape[0]
        return (not batch.prefills and not batch.grouped_runs and batch.decode_rows.shape[0] == n
                and batch.logits_rows.shape[0] == n and n <= self.buckets[-1]
                and batch.decode_tables.shape[1] <= self.inputs.tables.shape[1])

    def run(self, batch: PagedBatch) -> torch.Tensor:
        """-> logits (B, V) of the batch's B decode rows, through the bucket's graph."""
        B = batch.tokens.shape[0]
        bucket = bucket_for(self.buckets, B)
        self.padded_steps += 1
        if not self.record:
            self.inputs.load(batch, bucket)
            return run_padded_decode(self.runner, self.inputs, bucket)[:B]
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        self.inputs.load(batch, bucket)
        graph, logits = self.graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:B].clone()       # the graph's output buffer: the next replay overwrites it

    def _capture(self, bucket: int) -> tuple:
        """Record the bucket's forward. The warm-up runs for real, so every row is padding first:
        stale slots of an earlier step would overwrite K/V that now belongs to someone else."""
        self.inputs.pad(0, bucket)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):         # torch's rule: warm up on a side stream before capturing
            for _ in range(2):                  # compiles the Triton kernels, sets up cuBLAS workspaces
                run_padded_decode(self.runner, self.inputs, bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = run_padded_decode(self.runner, self.inputs, bucket)      # (b, V), lives in the pool
        self.pool = graph.pool()
        return graph, logits


def make_decode_graphs(runner, max_num_seqs: int, max_blocks: int) -> DecodeGraphs | None:
    """Graphs for a runner on the Triton paged path (CUDA, or CPU under the interpreter); None where
    they do not apply: the CPU gather path, or an int8/fp8 KV cache (the runner then has use_triton False)."""
    return DecodeGraphs(runner, max_num_seqs, max_blocks) if runner.use_triton else None
