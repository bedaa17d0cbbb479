"""launch(fn, size, *args): fn(rank, size, *args) on `size` fresh processes in one gloo group.

Tests, the benchmark and the notebook use it to run a layer or a model on every rank and compare
with the unsplit one; each rank's return value (picklable) comes back in rank order. A rank that
raises makes launch raise with that rank's traceback; nothing outlives the call.
"""
from __future__ import annotations

import os
import queue
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .workers import caller_script_hidden, free_port


def _run(rank: int, size: int, init: str, threads: int, fn, args, results) -> None:
    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size)
        out = fn(rank, size, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        results.close()
        results.join_thread()                      # the message must leave before the process does
        os._exit(1)


def launch(fn, size: int, *args, timeout: float = 300.0, threads: int | None = None) -> list:
    """fn must be importable (a module-level function). threads: torch threads per rank
    (default: this machine's threads shared out, at least 1)."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"size = {size!r} is invalid; allowed: an integer >= 1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    threads = threads or max(1, torch.get_num_threads() // size)
    init = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_run, args=(rank, size, init, threads, fn, args, results), daemon=True)
             for rank in range(size)]
    with caller_script_hidden(hide=getattr(fn, "__module__", None) != "__main__"):
        for p in procs:
            p.start()
    got: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < size:
            try:
                rank, ok, out = results.get(timeout=1.0)
            except queue.Empty:
                _check_alive(procs, got, fn, deadline, timeout)
                continue
            if not ok:
                last = out.strip().splitlines()[-1]            # the exception itself, then where it came from
                raise RuntimeError(f"rank {rank} of {size} failed in {fn.__name__}: {last}\n{out}")
            got[rank] = out
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(size)]


def _check_alive(procs, got: dict, fn, deadline: float, timeout: float) -> None:
    """No answer yet: fail at once if a rank died without one, or when the time is up."""
    for rank, p in enumerate(procs):
        if rank not in got and p.exitcode not in (None, 0):
            raise RuntimeError(f"rank {rank} of {len(procs)} died in {fn.__name__} (exit code {p.exitcode})")
    if time.monotonic() > deadline:
        raise TimeoutError(f"launch({fn.__name__}): no answer from some rank within {timeout} s")
