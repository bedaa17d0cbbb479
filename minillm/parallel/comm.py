"""Every byte the parallel code sends goes through here, so it can be counted.

Tensor and pipeline parallelism are paid for in communication. To check the lesson's formulas
(TP: 2 all-reduces of hidden x dtype per token per layer; PP: one activation per stage boundary)
against the code, the layers never call torch.distributed directly: they call these wrappers,
which do the collective and add its payload (the tensor's bytes, what one rank hands over) to
COUNTS under the operation's name. A ring all-reduce moves 2 (N-1)/N x payload over each link;
the calculator (minillm/parallel/calculator.py) applies that factor, the counter does not.
"""
from __future__ import annotations

import pickle
from collections import Counter

import torch
import torch.distributed as dist

COUNTS: Counter = Counter()       # "all_reduce.bytes", "all_reduce.calls", "send.bytes", ...


def reset_counts() -> None:
    COUNTS.clear()


def _count(op: str, nbytes: int) -> None:
    COUNTS[f"{op}.calls"] += 1
    COUNTS[f"{op}.bytes"] += nbytes


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(x: torch.Tensor, group=None) -> torch.Tensor:
    """Sum x over the ranks of group, in place; returns x."""
    _count("all_reduce", nbytes(x))
    dist.all_reduce(x, group=group)
    return x


def all_gather_last(x: torch.Tensor, group=None) -> torch.Tensor:
    """(..., n) on each of N ranks -> (..., N * n), rank 0's columns first (gloo needs equal sizes)."""
    _count("all_gather", nbytes(x))
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


def send(x: torch.Tensor, dst: int):
    """Start sending x to rank dst; returns the work handle (wait on it before x is reused)."""
    _count("send", nbytes(x))
    return dist.isend(x.contiguous(), dst)


def recv(shape, dtype, src: int, device="cpu") -> torch.Tensor:
    """Receive a tensor of known shape and dtype from rank src (both sides know the batch)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, src)
    return x


def broadcast_object(obj=None, src: int = 0, group=None):
    """The driver's step metadata to every rank (pickled; its size is counted on the sender)."""
    box = [obj]
    if dist.get_rank() == src:
        _count("broadcast", len(pickle.dumps(obj)))
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]
