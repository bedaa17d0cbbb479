"""The processes: rank 0 (the driver, where LLM lives) and N-1 workers that follow its steps.

    LLM(model, tensor_parallel_size=3)           # spawns ranks 1, 2; each loads and shards the model
      llm.generate(...)                           # the engine runs on rank 0; per step:
          rank 0: broadcast ("step", block copies, batch)  ->  every rank: its shard's forward
      llm.close()                                 # broadcast ("close",); join; kill what is left

Two ways to get the ranks, one code path after that:
  - spawned (the default): torch.multiprocessing "spawn" children, rendezvous on a free local TCP
    port; the children are daemons, ignore Ctrl-C (the driver decides when they stop) and exit when
    the driver's process disappears (a watchdog thread), so nothing is left behind on close, on an
    error, on Ctrl-C or when the driver is killed.
  - torchrun (WORLD_SIZE is set): every rank runs the same command; rank 0 drives, the others serve
    steps from inside LLM(...) and end their process when the driver closes. This is also how the
    group spans machines (lesson 11 gives the two-node command).

The backend is gloo on CPU; NCCL would be the one on CUDA (one GPU per rank: cuda:<local rank>).
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from minillm.model.llama import Llama
from minillm.model.positions import RopeTable
from minillm.model.runner import ModelRunner, PagedKVCache
from minillm.model.transforms import fuse_projections
from .comm import COUNTS, broadcast_object, reset_counts
from .expert import shard_experts
from .pipeline import pipeline_step, split_batch, stage_model
from .tensor import shard_model

MODES = ("tensor", "pipeline", "expert")
TIMEOUT = timedelta(minutes=30)           # a collective waits this long for a silent peer
JOINED = "minillm/joined"                 # store counter: spawned workers that reached rank 0's store


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_of(model: Llama, mode: str, rank: int, size: int) -> Llama:
    """What rank holds: a tensor-parallel shard, a pipeline stage, or the model with 1/size of each MoE layer's
    routed experts (every rank runs the whole batch; its MoE layers split the tokens among the ranks)."""
    if mode == "expert":
        return shard_experts(model, rank, size, replicated=True)
    return shard_model(model, rank, size) if mode == "tensor" else stage_model(model, rank, size)


def model_source(model: Llama, name: str | None) -> tuple:
    """How a worker gets the model: ("load", name) loads it like the driver did; ("state", cfg,
    weights) for a module built in memory (tests), without the fused views fuse_projections adds."""
    if name is not None:
        return ("load", name)
    if type(model) is not Llama:            # the workers rebuild a Llama: another forward would run there
        raise ValueError(f"a tensor- or pipeline-parallel LLM sends its workers a Llama's config and weights; the "
                         f"module is a {type(model).__qualname__}, whose own code would not run on the other ranks. "
                         f"Allowed: a minillm.model.llama.Llama, or a model name or path")
    weights = {k: v for k, v in model.state_dict().items() if ".wqkv." not in k and ".w_gate_up." not in k}
    return ("state", model.cfg, weights)


def _load(source: tuple, dtype: str, device) -> Llama:
    if source[0] == "load":
        from minillm.loading.loader import load_model
        return load_model(source[1], dtype=dtype, device=device)[0]
    _, cfg, weights = source
    with torch.device("meta"):
        model = Llama(cfg)
    model.load_state_dict(weights, assign=True)
    return model.to(device).eval()


# --- worker side -----------------------------------------------------------------------------

def serve(model: Llama, mode: str, rank: int, size: int) -> None:
    """Follow rank 0's messages until ("close",): build the engine's cache part, run each step."""
    fuse_projections(model)
    runner = None
    while True:
        msg = broadcast_object()
        if msg[0] == "close":
            return
        if msg[0] == "engine":
            opts = msg[1]
            device = model.embed.weight.device
            kv = PagedKVCache(model.cfg, opts["num_blocks"], opts["block_size"], model.embed.weight.dtype, device,
                              opts["kv_cache_dtype"])
            runner = ModelRunner(model, kv, RopeTable(model.cfg.head_dim, model.cfg.rope_theta, opts["max_len"], device,
                                                              model.cfg.rope_scaling))
        elif msg[0] == "counts":                          # the bytes this rank sent, for the driver
            dist.gather_object(dict(COUNTS), None, dst=0)
            if msg[1]:
                reset_counts()
        elif msg[0] == "step":
            _, copies, batch = msg
            runner.kv.copy_blocks(copies)
            if mode in ("tensor", "expert"):
                runner.forward(batch)                             # the collectives pair up with rank 0's
            else:
                pipeline_step(runner, batch, rank, size)


def _watch_parent(parent_pid: int) -> None:
    """End this worker when the driver's process is gone (killed: it cannot say "close")."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


def _worker_main(rank: int, size: int, port: int, mode: str, source: tuple, dtype: str, device: str,
                 threads: int, parent_pid: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C reaches the whole process group: the driver decides
    _watch_parent(parent_pid)
    torch.set_num_threads(threads)
    device = torch.device(device if device == "cpu" else f"cuda:{rank}")
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=TIMEOUT)
    store.add(JOINED, 1)                                # rank 0 counts these while it watches for dead workers
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    try:
        serve(part_of(_load(source, dtype, device), mode, rank, size), mode, rank, size)
    except Exception:                                   # the driver sees the broken connection; say why here
        traceback.print_exc()
        os._exit(1)
    dist.destroy_process_group()


# --- driver side -----------------------------------------------------------------------------

class BroadcastKV(PagedKVCache):
    """Rank 0's part of the paged cache: block copies (copy-on-write) are also queued for the workers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pending: list[tuple[int, int]] = []

    def copy_blocks(self, copies):
        super().copy_blocks(copies)
        self.pending += copies

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self.pending = self.pending, []
        return copies


class Workers:
    """Rank 0's handle on the group."""

    def __init__(self, mode: str, size: int, processes: list, spawned: bool, threads: int):
        self.mode, self.size, self.processes, self.spawned = mode, size, processes, spawned
        self.threads = threads                            # rank 0's torch threads before the group started
        self.broken = self.closed = False
        self.num_micro_batches = size                     # pipeline: GPipe micro-batches per engine step
        self.timing: dict = {}                            # pipeline: rank 0's busy / wall seconds

    @contextlib.contextmanager
    def step(self):
        """Run one collective exchange; an exception inside leaves the ranks out of step: no more use."""
        if self.closed or self.broken:
            raise RuntimeError(f"the {self.mode}-parallel workers are {'closed' if self.closed else 'broken by an earlier error'}; "
                               f"make a new LLM")
        try:
            yield
        except Exception as e:                         # e.g. a worker died: gloo reports the closed connection
            self.broken = True
            raise RuntimeError(f"a {self.mode}-parallel step failed ({type(e).__name__}: {e}); the ranks are out "
                               f"of step: close() this LLM and make a new one") from e
        except BaseException:                          # Ctrl-C: stop as asked; close() kills the workers
            self.broken = True
            raise

    def start_engine(self, model: Llama, rope: RopeTable, num_blocks: int, block_size: int, kv_cache_dtype: str):
        """The engine's (kv, runner) on rank 0; the workers build their parts of the same cache."""
        opts = dict(num_blocks=num_blocks, block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                    max_len=rope.rotation.shape[0])
        with self.step():
            broadcast_object(("engine", opts))
        kv = BroadcastKV(model.cfg, num_blocks, block_size, model.embed.weight.dtype, model.embed.weight.device,
                         kv_cache_dtype)
        return kv, DistributedRunner(model, kv, rope, self)

    def counts(self, reset: bool = False) -> list[dict]:
        """Every rank's comm.COUNTS (what it sent), rank 0 first; reset: start counting again."""
        mine = dict(COUNTS)                               # before the request below is counted
        every = [None] * self.size
        with self.step():
            broadcast_object(("counts", reset))
            dist.gather_object(mine, every, dst=0)
        if reset:
            reset_counts()
        return every

    def close(self) -> None:
        if self.closed:
            return
        if not self.broken and dist.is_initialized():
            with contextlib.suppress(Exception):
                broadcast_object(("close",))
        self.closed = True
        for p in self.processes:                          # broken: they wait in a collective that never ends
            p.join(timeout=0 if self.broken else 10)
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join()
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        torch.set_num_threads(self.threads)


class DistributedRunner(ModelRunner):
    """The engine's runner on rank 0: sends each step to the workers, then runs rank 0's part."""

    def __init__(self, model: Llama, kv: BroadcastKV, rope: RopeTable, workers: Workers):
        super().__init__(model, kv, rope)
        self.workers = workers

    def forward(self, batch):
        w = self.workers
        with w.step():
            if w.mode in ("tensor", "expert"):
                broadcast_object(("step", self.kv.take_copies(), batch))
                return super().forward(batch)
            micro = split_batch(batch, w.num_micro_batches, self.kv.block_size)
            broadcast_object(("step", self.kv.take_copies(), micro))
            return pipeline_step(self, micro, 0, w.size, w.timing)


def start(model: Llama, name: str | None, mode: str, size: int, dtype: str,
          device: torch.device) -> tuple[Workers, Llama]:
    """Start (or, under torchrun, join) the group; -> (workers, rank 0's part of the model).
    model: the loaded Llama; name: what it was loaded from (the workers load it again), None
    for a module built in memory (its weights travel to the workers)."""
    if mode not in MODES:
        raise ValueError(f"parallel mode {mode!r} is not supported; allowed: {', '.join(MODES)}")
    if "WORLD_SIZE" in os.environ:
        return _join_torchrun(model, mode, size, device)
    if dist.is_initialized():
        raise ValueError("a tensor- or pipeline-parallel LLM is already running in this process; close() it first")
    source = model_source(model, name)                  # refuses a module the workers cannot rebuild
    part = part_of(model, mode, 0, size)                # checks the size before any process starts
    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
    threads = max(1, torch.get_num_threads() // size)
    processes = [ctx.Process(target=_worker_main, daemon=True, name=f"minillm-{mode}-rank{rank}",
                             args=(rank, size, store.port, mode, source, dtype, str(device.type), threads, os.getpid()))
                 for rank in range(1, size)]
    with caller_script_hidden():
        for p in processes:
            p.start()
    workers = Workers(mode, size, processes, spawned=True, threads=torch.get_num_threads())
    try:
        _wait_until_joined(store, processes, mode)
        dist.init_process_group(backend_for(device), store=store, rank=0, world_size=size, timeout=TIMEOUT)
    except BaseException:
        workers.broken = True
        workers.close()
        raise
    torch.set_num_threads(threads)
    return workers, part


@contextlib.contextmanager
def caller_script_hidden(hide: bool = True):
    """While spawned processes start, hide the caller's main module (its file and module name) from
    multiprocessing: a spawned child would otherwise run the caller's script again before its target, and a
    script (a notebook's source among them) that builds a parallel LLM at the top would spawn without end.
    Safe because every target here is a library function with picklable arguments; what the caller's script
    itself defines cannot reach a worker (launch() keeps the script for a fn defined there: hide=False)."""
    main = sys.modules["__main__"]
    saved = {key: main.__dict__[key] for key in ("__file__", "__spec__") if key in main.__dict__}
    if hide:
        main.__dict__.pop("__file__", None)
        main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__file__", None)
        main.__dict__.update(saved)


def _wait_until_joined(store: dist.TCPStore, processes: list, mode: str) -> None:
    """Until every spawned worker has reached the store. A worker that exits before that fails the
    start at once, where the rendezvous alone would wait TIMEOUT for it."""
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while store.add(JOINED, 0) < len(processes):
        dead = next((p for p in processes if p.exitcode is not None), None)
        if dead is not None:
            raise RuntimeError(
                f"{mode}-parallel worker {dead.name} exited with code {dead.exitcode} before joining the group "
                "(its error is printed above)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the {mode}-parallel workers did not join within {TIMEOUT}")
        time.sleep(0.05)


def _join_torchrun(model, mode: str, size: int, device: torch.device) -> tuple[Workers, Llama]:
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"torchrun started {world} processes but {mode}_parallel_size is {size}; "
                         f"allowed: --nproc-per-node x --nnodes = {size}")
    if device.type == "cuda":
        device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}")
    if not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method="env://", timeout=TIMEOUT)
    rank = dist.get_rank()
    part = part_of(model, mode, rank, size)
    if rank != 0:                                       # a worker: follow the driver, then end the process
        serve(part, mode, rank, size)
        dist.destroy_process_group()
        sys.exit(0)
    return Workers(mode, size, [], spawned=False, threads=torch.get_num_threads()), part
