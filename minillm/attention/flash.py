"""FlashAttention: exact attention without ever materialising the (Tq, Tk) score matrix.

Three versions of the same function sit side by side:

    naive_attention_in_dtype  S = Q K^T, P = softmax(S), O = P V in q's own dtype (on fp32
                              inputs, the definition of right): it materialises two (Tq, Tk)
                              matrices per head, O(N^2) memory. (model.llama.naive_attention_fp32 is
                              the model's baseline, which computes in fp32 whatever q's dtype.)
    flash_attention_torch     NEW: the online-softmax algorithm in plain PyTorch, with explicit
                              (block_m x block_n) tiles, the same tiling as the Triton kernel in
                              kernels/flash_attention.py. Memory O(N) plus one tile.
    flash_attention           the user-facing, differentiable function: forward by the Triton
                              kernel or the torch twin, backward by tiled recomputation from the
                              saved log-sum-exp (FlashAttention-2 style), so it also works for
                              training: the Triton backward (kernels/flash_attention_backward.py)
                              on CUDA or with backend="triton", flash_attention_backward_torch else.

Layout everywhere: q (B, Hq, Tq, D), k and v (B, Hkv, Tk, D), Hq % Hkv == 0. Grouped-query
attention: query head h reads KV head h // (Hq // Hkv). With causal=True and Tq < Tk (prefill
after a cached prefix) query i sits at absolute position (Tk - Tq) + i and sees keys
0 .. (Tk - Tq) + i.

Online softmax, per query row, one key tile s at a time (m: running max, l: running sum):
    m_new = max(m, rowmax(s));  p = exp(s - m_new);  alpha = exp(m - m_new)
    l = l * alpha + rowsum(p);  acc = acc * alpha + p @ V_tile;  m = m_new
    at the end O = acc / l and LSE = m + log(l), the row's log-sum-exp, kept for backward.
"""
from __future__ import annotations

import math

import torch

from minillm.kernel_support.args import MAX_HEAD_DIM, check_attention_inputs  # shared with the Triton kernel
from minillm.model.positions import causal_mask

BACKENDS = ("auto", "triton", "torch")


def _check_block(value: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


# ----------------------------------------------------------------------------- (a) naive baseline

def _naive_scores(q, k, v, causal: bool, scale: float):
    """S = scale * QK^T with the causal mask applied, and V expanded to the query heads."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)                 # (B, Hq, Tk, D): the baseline copies K and V per query head
    v = v.repeat_interleave(group, dim=1)                 # (B, Hq, Tk, D)
    s = (q @ k.transpose(-1, -2)) * scale                 # (B, Hq, Tq, Tk): the N^2 matrix, written out in full
    if causal:
        s = s.masked_fill(~causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))   # (Tq, Tk) mask
    return s, v


def naive_attention_in_dtype(q, k, v, causal: bool = True, sm_scale: float | None = None) -> torch.Tensor:
    """Standard attention in q's dtype: materialise S = QK^T and P = softmax(S), then O = PV."""
    s, v = _naive_scores(q, k, v, causal, check_attention_inputs(q, k, v, causal, sm_scale))
    p = torch.softmax(s, dim=-1)                          # (B, Hq, Tq, Tk): a second N^2 matrix
    return p @ v                                          # (B, Hq, Tq, D)


def naive_attention_in_dtype_lse(q, k, v, causal: bool = True, sm_scale: float | None = None):
    """naive_attention_in_dtype plus the rows' log-sum-exp: (o (B, Hq, Tq, D), lse (B, Hq, Tq) fp32)."""
    s, v = _naive_scores(q, k, v, causal, check_attention_inputs(q, k, v, causal, sm_scale))
    o = torch.softmax(s, dim=-1) @ v                      # (B, Hq, Tq, D)
    return o, torch.logsumexp(s.float(), dim=-1)          # lse: (B, Hq, Tq)


# ----------------------------------------------------------------------------- (b) NEW: tiled online softmax

def online_softmax_steps(scores: list[float], values: list[float], tile: int) -> list[tuple[float, float, float]]:
    """One query row's running state (m, l, acc) after each tile of `tile` keys, on plain floats:
    the update of the module docstring with a scalar value per key, for working it by hand. The
    last state gives O = acc / l and LSE = m + log(l), exactly softmax(scores) @ values."""
    m, l, acc, states = float("-inf"), 0.0, 0.0, []
    for start in range(0, len(scores), tile):
        s, v = scores[start:start + tile], values[start:start + tile]
        m_new = max(m, *s)
        alpha = math.exp(m - m_new)                       # rescales what was summed under the old max
        p = [math.exp(x - m_new) for x in s]
        l = l * alpha + sum(p)
        acc = acc * alpha + sum(pi * vi for pi, vi in zip(p, v))
        m = m_new
        states.append((m, l, acc))
    return states


def flash_attention_torch(q, k, v, causal: bool = True, sm_scale: float | None = None,
                          block_m: int = 64, block_n: int = 64):
    """Online-softmax attention over (block_m x block_n) tiles; returns (o, lse (B, Hq, Tq) fp32).

    One pass of the outer loop is what one Triton program does: it owns block_m query rows,
    streams K and V tiles past them and keeps only m, l and acc. Batch and heads are batched
    tensor dimensions here (the kernel's second grid axis).
    """
    scale = check_attention_inputs(q, k, v, causal, sm_scale)
    _check_block(block_m, "block_m")
    _check_block(block_n, "block_n")
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    offset = Tk - Tq                                      # absolute position of query 0
    qg = q.unflatten(1, (Hkv, Hq // Hkv))                 # (B, Hkv, G, Tq, D): G query heads share one KV head
    kg, vg = k.unsqueeze(2), v.unsqueeze(2)               # (B, Hkv, 1, Tk, D): broadcast over G, no copy
    o = torch.empty_like(qg)                              # (B, Hkv, G, Tq, D)
    lse = torch.empty(qg.shape[:-1], dtype=torch.float32, device=q.device)   # (B, Hkv, G, Tq)

    # BEGIN SOLUTION online_softmax
    for start_m in range(0, Tq, block_m):
        q_tile = qg[..., start_m:start_m + block_m, :].float()               # (B, Hkv, G, bm, D)
        bm = q_tile.shape[-2]
        rows = offset + start_m + torch.arange(bm, device=q.device)          # (bm,) absolute positions
        m = torch.full(q_tile.shape[:-1], float("-inf"), device=q.device)    # (B, Hkv, G, bm) running max
        l = torch.zeros(q_tile.shape[:-1], device=q.device)                  # (B, Hkv, G, bm) running sum
        acc = torch.zeros_like(q_tile)                                       # (B, Hkv, G, bm, D) unnormalised output
        # causal: keys after the last row's position are invisible to the whole tile, so skip those tiles
        end_n = min(Tk, offset + start_m + bm) if causal else Tk
        for start_n in range(0, end_n, block_n):
            k_tile = kg[..., start_n:start_n + block_n, :].float()           # (B, Hkv, 1, bn, D)
            v_tile = vg[..., start_n:start_n + block_n, :].float()           # (B, Hkv, 1, bn, D)
            bn = k_tile.shape[-2]
            s = (q_tile @ k_tile.transpose(-1, -2)) * scale                  # (B, Hkv, G, bm, bn): one tile only
            if causal and start_n + bn - 1 > rows[0]:                        # only tiles crossing the diagonal need a mask
                cols = start_n + torch.arange(bn, device=q.device)           # (bn,)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))                         # (B, Hkv, G, bm)
            p = torch.exp(s - m_new[..., None])                              # (B, Hkv, G, bm, bn)
            alpha = torch.exp(m - m_new)                                     # rescales what was summed under the old max
            l = l * alpha + p.sum(dim=-1)
            acc = acc * alpha[..., None] + p @ v_tile
            m = m_new
        o[..., start_m:start_m + bm, :] = (acc / l[..., None]).to(q.dtype)
        lse[..., start_m:start_m + bm] = m + torch.log(l)
    # END SOLUTION
    return o.flatten(1, 2), lse.flatten(1, 2)             # (B, Hq, Tq, D), (B, Hq, Tq)


def flash_attention_backward_torch(q, k, v, o, lse, do, causal: bool = True, sm_scale: float | None = None,
                                   block_m: int = 64, block_n: int = 64):
    """NEW: gradients (dq, dk, dv) by recomputing P tile by tile from the saved LSE.

    Nothing of size (Tq, Tk) was stored by the forward pass: P = exp(S - LSE) is rebuilt per
    tile (activation checkpointing inside the kernel). With D_i = rowsum(dO_i * O_i):
        dV = P^T dO,  dP = dO V^T,  dS = P * (dP - D),  dQ = dS K * scale,  dK = dS^T Q * scale.
    The outer loop runs over key tiles, as in FlashAttention-2, so dK and dV of a tile are
    finished in one place; the query heads of a GQA group add into their shared KV head.
    """
    scale = check_attention_inputs(q, k, v, causal, sm_scale)
    _check_block(block_m, "block_m")
    _check_block(block_n, "block_n")
    B, Hq, Tq, D = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    offset = Tk - Tq
    qg = q.unflatten(1, (Hkv, Hq // Hkv)).float()                       # (B, Hkv, G, Tq, D)
    dog = do.unflatten(1, (Hkv, Hq // Hkv)).float()                     # (B, Hkv, G, Tq, D)
    lseg = lse.unflatten(1, (Hkv, Hq // Hkv))                           # (B, Hkv, G, Tq)
    delta = (dog * o.unflatten(1, (Hkv, Hq // Hkv)).float()).sum(-1)    # (B, Hkv, G, Tq)
    kf, vf = k.float(), v.float()                                       # (B, Hkv, Tk, D)
    dq = torch.zeros_like(qg)                                           # (B, Hkv, G, Tq, D)
    dk = torch.zeros_like(kf)                                           # (B, Hkv, Tk, D)
    dv = torch.zeros_like(vf)                                           # (B, Hkv, Tk, D)

    for start_n in range(0, Tk, block_n):
        k_tile = kf[:, :, None, start_n:start_n + block_n]              # (B, Hkv, 1, bn, D)
        v_tile = vf[:, :, None, start_n:start_n + block_n]              # (B, Hkv, 1, bn, D)
        bn = k_tile.shape[-2]
        cols = start_n + torch.arange(bn, device=q.device)              # (bn,)
        # causal: query rows whose position is below start_n see nothing of this tile
        first_m = (max(0, start_n - offset) // block_m) * block_m if causal else 0
        for start_m in range(first_m, Tq, block_m):
            sl = slice(start_m, start_m + block_m)
            q_tile, do_tile = qg[..., sl, :], dog[..., sl, :]           # (B, Hkv, G, bm, D)
            s = (q_tile @ k_tile.transpose(-1, -2)) * scale             # (B, Hkv, G, bm, bn)
            if causal:
                rows = offset + start_m + torch.arange(q_tile.shape[-2], device=q.device)   # (bm,)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            p = torch.exp(s - lseg[..., sl, None])                      # (B, Hkv, G, bm, bn) recomputed probabilities
            dv[:, :, start_n:start_n + bn] += (p.transpose(-1, -2) @ do_tile).sum(2)
            dp = do_tile @ v_tile.transpose(-1, -2)                     # (B, Hkv, G, bm, bn)
            ds = p * (dp - delta[..., sl, None])                        # (B, Hkv, G, bm, bn) softmax backward
            dq[..., sl, :] += (ds @ k_tile) * scale
            dk[:, :, start_n:start_n + bn] += (ds.transpose(-1, -2) @ q_tile).sum(2) * scale
    return dq.flatten(1, 2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# ----------------------------------------------------------------------------- the user-facing function

def triton_usable(device: torch.device) -> bool:
    """Can the Triton kernel run on this device? CUDA, or CPU under TRITON_INTERPRET=1.

    The env var must be set before kernels/flash_attention.py is first imported: triton decides
    at decoration time whether a kernel is compiled or interpreted.
    """
    try:
        from kernels import flash_attention as kernel
    except ImportError:                                   # no triton installed: the torch twin runs instead
        return False
    if device.type == "cuda":
        return not kernel.INTERPRETED
    return device.type == "cpu" and kernel.INTERPRETED


def attention_forward(q, k, v, causal: bool = True, sm_scale: float | None = None, backend: str = "auto"):
    """(o, lse) by the chosen backend: "triton" (the kernel), "torch" (the tiled twin) or "auto"."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if triton_usable(q.device) and q.shape[-1] <= MAX_HEAD_DIM else "torch"
    if backend == "triton":
        if not triton_usable(q.device):
            raise ValueError("backend='triton' needs a CUDA tensor, or a CPU tensor with TRITON_INTERPRET=1 "
                             "set before the kernel module is imported")
        from kernels.flash_attention import triton_flash_attention_forward
        return triton_flash_attention_forward(q, k, v, causal, sm_scale)
    return flash_attention_torch(q, k, v, causal, sm_scale)


def attention_backward(q, k, v, o, lse, do, causal: bool = True, sm_scale: float | None = None,
                       backend: str = "auto"):
    """(dq, dk, dv) by the chosen backend: "triton" (kernels/flash_attention_backward.py), "torch"
    (flash_attention_backward_torch) or "auto": the Triton backward on CUDA, the torch twin
    elsewhere (on CPU the interpreted kernel would be correct but far slower than the twin)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        cuda = q.device.type == "cuda"
        backend = "triton" if cuda and triton_usable(q.device) and q.shape[-1] <= MAX_HEAD_DIM else "torch"
    if backend == "triton":
        if not triton_usable(q.device):
            raise ValueError("backend='triton' needs a CUDA tensor, or a CPU tensor with TRITON_INTERPRET=1 "
                             "set before the kernel module is imported")
        from kernels.flash_attention_backward import triton_flash_attention_backward
        return triton_flash_attention_backward(q, k, v, o, lse, do.contiguous(), causal, sm_scale)
    return flash_attention_backward_torch(q, k, v, o, lse, do, causal, sm_scale)


class FlashAttentionFunction(torch.autograd.Function):
    """Forward saves only q, k, v, o and the (B, Hq, Tq) LSE; backward recomputes P from them,
    with the same backend switch as the forward (attention_backward)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, sm_scale, backend):
        scale = check_attention_inputs(q, k, v, causal, sm_scale)
        o, lse = attention_forward(q, k, v, causal, scale, backend)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.backend = causal, scale, backend
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(q, k, v, o, lse, do, ctx.causal, ctx.scale, ctx.backend)
        return dq, dk, dv, None, None, None


def flash_attention(q, k, v, causal: bool = True, sm_scale: float | None = None,
                    backend: str = "auto") -> torch.Tensor:
    """Exact attention, O(N) memory, differentiable. Returns o (B, Hq, Tq, D) in q's dtype.

    backend (the switch):
        "auto"   the Triton kernel when it can run (CUDA, or CPU with TRITON_INTERPRET=1), else "torch"
        "triton" the kernel in kernels/flash_attention.py; a ValueError if it cannot run here
        "torch"  flash_attention_torch, the plain-PyTorch twin with the same tiling
    The backward pass recomputes P tile by tile from the saved LSE: the Triton backward
    (kernels/flash_attention_backward.py) when backend="triton", or "auto" on CUDA; otherwise
    flash_attention_backward_torch.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return FlashAttentionFunction.apply(q, k, v, causal, sm_scale, backend)



# ----------------------------------------------------------------------------- the backward, timed

def time_triton_backward(q, k, v, causal: bool, reference, samples: int = 10) -> dict:
    """The Triton backward (from the Triton forward's o and lse) against autograd through `reference`
    (q, k, v, causal) -> o, its graph built once and kept: ms each, the fraction (reference's time over
    ours) and the largest gradient difference. Same q, k, v and dO for both; lesson 05 reports it on
    a GPU against SDPA's flash backend."""
    from kernels.flash_attention import triton_flash_attention_forward
    from kernels.flash_attention_backward import triton_flash_attention_backward
    from minillm.perf.kernel_timing import time_kernel

    device = q.device
    do = torch.randn_like(q)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = reference(*leaves, causal)
    ref = torch.autograd.grad(out, leaves, do, retain_graph=True)
    o, lse = triton_flash_attention_forward(q, k, v, causal)
    got = triton_flash_attention_backward(q, k, v, o, lse, do, causal)       # tunes on its first call
    ref_t = time_kernel(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True), device=device,
                        samples=samples, warmup=3)
    triton_t = time_kernel(lambda: triton_flash_attention_backward(q, k, v, o, lse, do, causal), device=device,
                           samples=samples, warmup=3)
    return {"sdpa_flash_backward_ms": 1e3 * ref_t["median_s"], "triton_backward_ms": 1e3 * triton_t["median_s"],
            "backward_fraction_of_sdpa": ref_t["median_s"] / triton_t["median_s"],
            "backward_max_grad_diff": max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref)),
            "backward_timing": triton_t["method"]}
