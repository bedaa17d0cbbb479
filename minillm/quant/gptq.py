"""GPTQ (Frantar et al. 2022): quantise a layer's columns one at a time, and after each one
adjust the columns not yet quantised so that the layer's *output* on calibration data moves as
little as possible.

For a linear layer y = W x the objective is || W X - Q X ||^2 over calibration inputs X.
Its Hessian with respect to one row of W is H = 2/n * sum_x x x^T (in, in), the same for every
row. Quantising column i alone leaves an error err_i = (w_i - q_i) / [H^-1]_ii that the optimal
update spreads over the remaining columns j > i as  w_j -= err_i * [H^-1]_ij  (optimal brain
surgeon, one column at a time, in a fixed order for all rows at once).

Engineering that makes it fast and stable, each a few lines below:
- dampening: add 1% of the mean diagonal to H's diagonal (H can be near-singular);
- "dead" inputs (never nonzero in calibration) get H_ii = 1 and their weights are zeroed;
- the Cholesky factor of H^-1 (upper) gives, row by row, exactly the [H^-1] rows the sequential
  updates need, without re-inverting after each column;
- lazy batch updates: columns are processed in blocks of 128; inside a block updates are
  immediate, the rest of the matrix gets one matrix-product update per block. Mathematically
  identical to blocksize 1 (tested), but memory-friendly;
- group size: a group's scale and zero point are chosen when its first column comes up, on the
  weights as already updated by earlier errors;
- act-order: process columns by decreasing H_ii (most active inputs first, while there is
  still freedom left to compensate). The codes are stored in that order with the permutation.
"""
from __future__ import annotations

import torch

from . import int4, replace_module
from .linear import QuantLinear
from .sequential import SUBLAYER_GROUPS, calibrate_sequentially, capture_inputs


class HessianAccumulator:
    """H = 2/n * sum over calibration tokens of x x^T, accumulated batch by batch."""

    def __init__(self, in_features: int, device=None):
        self.sum = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)  # (in, in)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:                  # x: (..., in)
        # BEGIN SOLUTION gptq
        x = x.reshape(-1, x.shape[-1]).float()               # (n, in)
        self.sum += x.T @ x
        self.count += x.shape[0]
        # END SOLUTION

    def hessian(self) -> torch.Tensor:
        # BEGIN SOLUTION gptq
        return 2 * self.sum / self.count
        # END SOLUTION


def inverse_hessian_factor(H: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor U of H^-1 (H^-1 = U^T U): row i of U, divided by U_ii, is the
    update direction for column i given that columns < i are already fixed."""
    # BEGIN SOLUTION gptq
    H = H.clone()
    H.diagonal().add_(damp * H.diagonal().mean())
    L = torch.linalg.cholesky(H)
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    # END SOLUTION


@torch.no_grad()
def gptq_quantize(w: torch.Tensor, H: torch.Tensor, *, bits: int = 4, group_size: int = 128,
                  symmetric: bool = False, blocksize: int = 128, damp: float = 0.01, act_order: bool = False):
    """W (out, in), H (in, in) -> codes (out, in) [in processing order], scale and zero (out, ng),
    perm (in,) or None. Computes in float64 when W is float64, else float32."""
    int4.check_bits(bits)
    int4.check_group_size(group_size)
    if not (isinstance(blocksize, int) and blocksize > 0 and (blocksize % group_size == 0 or group_size % blocksize == 0)):
        raise ValueError(f"blocksize = {blocksize!r} is invalid with group_size {group_size}; "
                         f"allowed: a positive multiple or divisor of group_size (1 and 128 are usual)")
    dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
    W, H = w.to(dtype).clone(), H.to(dtype).clone()          # (O, I), (I, I)
    O, I = W.shape
    dead = H.diagonal() == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = None
    if act_order:
        perm = torch.argsort(H.diagonal(), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    Hinv = inverse_hessian_factor(H, damp)                   # (I, I) upper triangular

    n_groups = -(-I // group_size)
    codes = torch.zeros(O, I, dtype=torch.float32, device=W.device)
    scale = torch.zeros(O, n_groups, dtype=torch.float32, device=W.device)
    zero = torch.zeros(O, n_groups, dtype=torch.float32, device=W.device)
    # BEGIN SOLUTION gptq
    for b0 in range(0, I, blocksize):
        b1 = min(b0 + blocksize, I)
        W1 = W[:, b0:b1].clone()                             # (O, nb): this block, updated eagerly
        err1 = torch.zeros_like(W1)                          # (O, nb): scaled errors, for the lazy update
        Hinv1 = Hinv[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:                        # a new group: params on the *updated* weights
                group = W[:, col:col + group_size] if i == 0 else W1[:, i:i + group_size]
                s, z = int4.scale_zero(group, bits, symmetric)               # (O,) each
                scale[:, col // group_size], zero[:, col // group_size] = s, z
            q = int4.quantize_codes(W1[:, i:i + 1], s, z, bits)[:, 0]        # (O,)
            codes[:, col] = q
            err = (W1[:, i] - (q - z) * s) / Hinv1[i, i]                     # (O,)
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]                # compensate inside the block
            err1[:, i] = err
        W[:, b1:] -= err1 @ Hinv[b0:b1, b1:]                 # lazy update of everything after the block
    # END SOLUTION
    return codes, scale, zero, perm


@torch.no_grad()
def quantize_model_gptq(model, ids: torch.Tensor, *, bits: int = 4, group_size: int = 128, symmetric: bool = False,
                        blocksize: int = 128, damp: float = 0.01, act_order: bool = True, progress: bool = False):
    """GPTQ every linear in model.layers, block by block, and within a block in the order
    (q, k, v) -> o -> (gate, up) -> down, each group calibrated on inputs that already pass
    through the quantised sublayers before it."""
    def quantize_block(_index, block, h, cos, sin):
        for names in SUBLAYER_GROUPS:
            acc = {name: HessianAccumulator(block.get_submodule(name).in_features, h.device) for name in names}
            capture_inputs(block, names, h, cos, sin, lambda name, x: acc[name].add(x))
            for name in names:
                linear = block.get_submodule(name)
                codes, s, z, perm = gptq_quantize(linear.weight, acc[name].hessian(), bits=bits, group_size=group_size,
                                                  symmetric=symmetric, blocksize=blocksize, damp=damp, act_order=act_order)
                tensors = int4.encode(codes, s, z, bits, symmetric, perm)
                replace_module(block, name, QuantLinear.from_linear(linear, "int", tensors,
                                                                    {"bits": bits, "group_size": group_size}))

    return calibrate_sequentially(model, ids, quantize_block, progress)
