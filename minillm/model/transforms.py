"""Load-time transforms of a loaded model: done once, before any request, never inside a step.

fuse_projections: q, k, v come from ONE matrix [wq; wk; wv] and gate, up from ONE [w_gate; w_up], so
a layer runs 2 projections where it ran 5 (fewer kernel calls, longer contiguous reads). In a latent
attention layer (MLA) the two projections of the layer's input, the query's (wq_a, or wq) and the latent's
(wkv_a), are the one matrix; a mixture of experts keeps its stacked experts as they are. The original
modules' weights become views into the fused ones: nothing is copied, and the naive model still runs
on the very same numbers. is_fused says whether that still holds (quantising or replacing a
projection after fusing breaks it); it only looks.

gemv_blocks: copies of the weights laid out for the one-token GEMV of the engine's compiled decode
step (rows in blocks of one cache line, layer.blocked_dot), in memory backed by huge pages. The cost
is memory: a second copy of every float projection and of the tied head (the originals stay for
prefills, batches and state_dict).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .llama import Llama
from .mla import LatentAttention
from .moe import MoE


def fuse_projections(model: Llama) -> Llama:
    """Add attn.wqkv and ffn.w_gate_up (in place); wq/wk/wv/w_gate/w_up become views of them."""
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        groups = [(attn, "wqkv", _input_projections(attn))]
        if not isinstance(ffn, MoE):
            groups.append((ffn, "w_gate_up", [ffn.w_gate, ffn.w_up]))
        if all(hasattr(owner, name) and _backs(getattr(owner, name), parts) for owner, name, parts in groups):
            continue                     # fused already (a deepcopy, in contrast, leaves stale copies: fuse again)
        if not all(type(m) is nn.Linear for _, _, parts in groups for m in parts):
            raise ValueError("fuse_projections needs plain nn.Linear projections (not quantised ones)")
        for owner, name, parts in groups:
            setattr(owner, name, _fuse(parts))
    return model


def _input_projections(attn) -> list[nn.Module]:
    """The projections that read the attention's input: wq, wk, wv; MLA's query one (wq_a or wq) and wkv_a."""
    if isinstance(attn, LatentAttention):
        return [attn.wq_a if attn.shape.q_lora_rank else attn.wq, attn.wkv_a]
    return [attn.wq, attn.wk, attn.wv]


CACHE_LINE_BYTES = 64        # x86's cache line: one block row of gemv_blocks
HUGE_PAGE_BYTES = 2 << 20    # x86-64's transparent huge page


def gemv_blocks(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each weight (out, in) -> its copy in row blocks (out/R, in, R), R = one cache line of weights
    (16 fp32, 32 bf16/fp16): block b holds rows b*R .. b*R+R-1 column by column, so a one-token GEMV
    (layer.blocked_dot) reads each block front to back, one cache line per step, into R running sums.
    R was chosen by end-to-end decode runs on the AMD EPYC VM (A/B runs not stored in results/): in
    bf16, 16 rows per block ran slower than 32 (one chain of dependent vector adds instead of two),
    in fp32, 32 rows slower than 16. A weight whose out is not a multiple of R comes back as it is
    (the row-wise dot runs it).
    All the copies live in one buffer backed by huge pages where the OS gives them (huge_page_buffer):
    a decode step streams every weight once, and with 4 KB pages it crosses a page, and misses the
    TLB, every 4 KB."""
    def rows(w):
        return CACHE_LINE_BYTES // w.element_size()

    blocked = [w.dim() == 2 and w.shape[0] % rows(w) == 0 for w in weights]
    sizes = [-(-w.numel() * w.element_size() // CACHE_LINE_BYTES) * CACHE_LINE_BYTES for w in weights]
    arena = huge_page_buffer(sum(n for n, b in zip(sizes, blocked) if b))
    out, offset = [], 0
    for w, n, b in zip(weights, sizes, blocked):
        if not b:
            out.append(w)
            continue
        (n_out, n_in), R = w.shape, rows(w)
        copy = arena[offset:offset + w.numel() * w.element_size()].view(w.dtype).view(n_out // R, n_in, R)
        copy.copy_(w.reshape(n_out // R, R, n_in).transpose(1, 2))
        out.append(copy)
        offset += n
    return out


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 buffer (nbytes,), starting at a huge-page boundary, whose pages Linux is
    asked to back with transparent huge pages. The memory is a fresh anonymous mapping of its own
    (mmap), advised (MADV_HUGEPAGE) before any page is touched, so the first write faults in 2 MB at
    a time; memory from torch's allocator could be heap pages touched before, which stay 4 KB. Where
    the OS has no such advice or THP is off, a plain buffer."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < HUGE_PAGE_BYTES or "[never]" in _thp_mode():
        return torch.empty(nbytes, dtype=torch.uint8)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # + room to align
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)                  # keeps the mapping alive
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start:start + nbytes]


def huge_page_kb(t: torch.Tensor) -> int:
    """How many kB of the mapping that holds t's memory Linux backs with transparent huge pages
    (AnonHugePages in /proc/self/smaps); 0 where there is no such file."""
    address = t.data_ptr()
    try:
        smaps = open("/proc/self/smaps")
    except OSError:
        return 0
    inside = False
    with smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and ":" not in head:                        # a mapping's first line: lo-hi ...
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def _thp_mode() -> str:
    """/sys/kernel/mm/transparent_hugepage/enabled, e.g. "always [madvise] never" ("" if absent)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read()
    except OSError:
        return ""


def is_fused(model: Llama) -> bool:
    """True while every fused matrix still backs the modules the baseline uses."""
    for layer in model.layers:
        attn, ffn = layer.attn, layer.ffn
        groups = [(attn, "wqkv", _input_projections(attn))]
        if not isinstance(ffn, MoE):
            groups.append((ffn, "w_gate_up", (ffn.w_gate, ffn.w_up)))
        for owner, name, parts in groups:
            fused = getattr(owner, name, None)
            if type(fused) is not nn.Linear or not _backs(fused, parts):
                return False
    return True


def _backs(fused: nn.Module, parts) -> bool:
    """The fused Linear's storage is the one its parts' weights view."""
    storage = fused.weight.untyped_storage().data_ptr()
    return all(type(p) is nn.Linear and p.weight.untyped_storage().data_ptr() == storage for p in parts)


def _fuse(linears: list[nn.Linear]) -> nn.Linear:
    weight = torch.cat([l.weight.data for l in linears])                  # (sum out, in)
    bias = None if linears[0].bias is None else torch.cat([l.bias.data for l in linears])
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                      device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=False)
    row = 0
    for l in linears:                                                     # re-point: views, no copy
        n = l.out_features
        l.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
        if bias is not None:
            l.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
        row += n
    return fused
