"""Every byte the parallel code sends goes through here, so it can be counted.

Tensor and pipeline parallelism are paid for in communication. To check the lesson's formulas
(TP: 2 all-reduces of hidden x dtype per token per layer; PP: one activation per stage boundary)
against the code, the layers never call torch.distributed directly: they call these wrappers,
which do the collective and add its payload (the tensor's bytes, what one rank hands over) to
COUNTS under the operation's name. A ring all-reduce moves 2 (N-1)/N x payload over each link;
the calculator (minillm/parallel/calculator.py) applies that factor, the counter does not.
"""
from __future__ import annotations

import math
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


def exchange_counts(counts: torch.Tensor, group=None) -> torch.Tensor:
    """counts (N, m) int64, row j meant for rank j -> (N, m), row j what rank j sent here: how many rows of each
    kind an all_to_all_rows will bring, so that every rank can size what it receives."""
    out = torch.empty_like(counts)
    _count("all_to_all_counts", nbytes(counts))
    dist.all_to_all_single(out, counts.contiguous(), group=group)
    return out


def all_to_all_rows(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], group=None) -> torch.Tensor:
    """x (sum(send_counts), ...): its first send_counts[0] rows go to rank 0, the next send_counts[1] to rank 1,
    ... -> the recv_counts[j] rows rank j sent here, in rank order. Counted: the bytes of the rows that
    leave this rank (those for itself stay local)."""
    rank = dist.get_rank(group)
    _count("all_to_all", x.element_size() * math.prod(x.shape[1:]) * (sum(send_counts) - send_counts[rank]))
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    dist.all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group=group)
    return out


def all_gather_rows(x: torch.Tensor, rows: list[int], group=None) -> torch.Tensor:
    """x (rows[rank], ...) on each rank -> every rank's rows in rank order (sum(rows), ...). gloo gathers equal
    sizes, so each rank pads to the largest share; counted: this rank's real rows."""
    _count("all_gather", x.element_size() * x.numel())
    most = max(rows)
    padded = torch.cat([x, x.new_zeros(most - x.shape[0], *x.shape[1:])]) if x.shape[0] < most else x
    parts = [torch.empty_like(padded) for _ in rows]
    dist.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([part[:n] for part, n in zip(parts, rows)])


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
