"""Fused 4-bit dequantise + matmul, in plain PyTorch: the twin of kernels/w4a16.py, same tiling.

    y (M, N) = x (M, K) @ W^T,   W (N, K) stored as packed 4-bit codes + one scale per group

Walk K in tiles of BLOCK_K columns, each inside one group. For a tile, load the packed bytes
(N, BLOCK_K/2): the high nibbles are the even columns, the low nibbles the odd columns. So instead
of interleaving them back, split x the same way and do two half-size products:

    acc += x[:, even] @ W_even^T + x[:, odd] @ W_odd^T          (fp32 accumulator)

W_even / W_odd are dequantised on the fly from the tile's codes and the group's scale (and zero
point, or the NF4 code table). The full-precision W never exists: on a GPU only the packed
bytes are read from memory, 4x fewer than fp16 weights, which is what decode is bound by.

Decode (a few rows of x) runs kernels/w4a16_gemv.py instead: int32 words of 8 codes, optionally
interleaved once at load time (gemv_words), scale and zero applied once per tile; its twin here is
w4a16_gemv_torch. A QuantLinear reaches the kernels through operands (its tensors in the matmul's
terms) and w4a16_linear, which picks the kernel and its tile configuration (choose_config); the tile
width comes from minillm/kernel_support/args.py, shared with the kernels.
"""
from __future__ import annotations

import torch

from minillm.kernel_support.args import w4a16_tile_k
from minillm.kernel_support.tuning import choose_config


def dequant_tile(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, code: torch.Tensor | None) -> torch.Tensor:
    """codes (N, n) uint8 of one group, scale / zero (N,) -> weights (N, n) float32."""
    if code is not None:                                                     # NF4: table lookup
        return code[codes.long()] * scale.float()[:, None]
    z = zero.float()[:, None] if zero is not None else 8.0                   # symmetric: z = 2^(4-1)
    return (codes.float() - z) * scale.float()[:, None]


def w4a16_matmul_torch(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                       code: torch.Tensor | None = None, *, group: int, block_k: int | None = None) -> torch.Tensor:
    """x (M, K), packed uint8 (N, K/2), scale (N, ceil(K/group)), zero like scale or None,
    code (16,) for NF4 or None -> y (M, N) in x.dtype."""
    M, K = x.shape
    N = packed.shape[0]
    block_k = block_k or w4a16_tile_k(group)
    acc = torch.zeros(M, N, dtype=torch.float32, device=x.device)            # (M, N)
    for k0 in range(0, K, block_k):
        k1 = min(k0 + block_k, K)
        byte = packed[:, k0 // 2:k1 // 2]                                    # (N, bk/2)
        g = k0 // group
        z = None if zero is None else zero[:, g]
        w_even = dequant_tile(byte >> 4, scale[:, g], z, code).to(x.dtype)   # (N, bk/2): columns k0, k0+2, ...
        w_odd = dequant_tile(byte & 0xF, scale[:, g], z, code).to(x.dtype)   # (N, bk/2): columns k0+1, k0+3, ...
        acc += x[:, k0:k1:2].float() @ w_even.float().T + x[:, k0 + 1:k1:2].float() @ w_odd.float().T
    return acc.to(x.dtype)


def gemv_words(packed: torch.Tensor, group: int, layout: int) -> torch.Tensor:
    """Packed bytes uint8 (N, K/2) -> int32 words (N, n_tiles * tile / 8) for kernels/w4a16_gemv.py, each row
    zero-padded to whole tiles (tile = w4a16_tile_k(group) columns). layout 0: the same bytes read four at a
    time (little-endian: word j holds columns 8j .. 8j+7, nibble i = column 8j + (i XOR 1)); layout 1
    (interleaved): inside each tile of 8W columns, nibble i of word j is column i * W + j."""
    N, half_k = packed.shape
    tile = w4a16_tile_k(group)
    padded = -(-2 * half_k // tile) * tile                                   # K rounded up to whole tiles
    codes = torch.nn.functional.pad(packed, (0, padded // 2 - half_k))      # (N, padded/2) uint8
    if layout == 0:
        return codes.contiguous().view(torch.int32)                          # (N, padded/8)
    if layout != 1:
        raise ValueError(f"layout must be 0 (stored bytes) or 1 (interleaved words), got {layout!r}")
    nibbles = torch.stack((codes >> 4, codes & 0xF), dim=-1).reshape(N, padded // tile, 8, tile // 8)
    nibbles = nibbles.transpose(2, 3).to(torch.int64)                        # (N, tiles, W, 8): word j, nibble i
    shifts = 4 * torch.arange(8, device=packed.device, dtype=torch.int64)
    word = (nibbles << shifts).sum(-1)                                       # (N, tiles, W) in [0, 2^32)
    word = torch.where(word >= 2**31, word - 2**32, word)                    # the same 32 bits as int32
    return word.to(torch.int32).reshape(N, padded // 8)


def w4a16_gemv_torch(x: torch.Tensor, words: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
                     code: torch.Tensor | None = None, *, group: int, layout: int) -> torch.Tensor:
    """The GEMV's arithmetic in PyTorch, one tile at a time: x (M, K), words int32 from gemv_words -> y (M, N).
    Per tile and row: s * sum_k x_k (q_k - z), or s * sum_k x_k code[q_k] for NF4."""
    M, K = x.shape
    tile = w4a16_tile_k(group)
    W = tile // 8
    j = torch.arange(W, device=x.device)
    acc = torch.zeros(M, words.shape[0], dtype=torch.float32, device=x.device)  # (M, N)
    for t in range(words.shape[1] // W):
        k0 = t * tile
        word = words[:, t * W:(t + 1) * W]                                   # (N, W) int32
        g = k0 // group
        z = (zero[:, g].float() if zero is not None else torch.full_like(scale[:, g], 8.0, dtype=torch.float32))
        xw = torch.zeros_like(acc)                                           # sum_k x_k (q_k - z) over the tile
        for i in range(8):
            q = (word >> (4 * i)) & 0xF                                      # (N, W)
            col = k0 + (8 * j + (i ^ 1) if layout == 0 else i * W + j)       # (W,) the columns nibble i holds
            xi = torch.where(col < K, x[:, col.clamp(max=K - 1)].float(), 0.0)   # (M, W)
            w = code[q.long()] if code is not None else q.float() - z[:, None]
            xw += xi @ w.T
        acc += xw * scale[:, g].float()
    return acc.to(x.dtype)


def operands(layer) -> dict:
    """A QuantLinear's tensors in the fused matmul's terms (group scales (N, ng), mode, permutation)."""
    if layer.fmt == "int" and layer.params["bits"] == 4:
        return dict(packed=layer.packed, scale=layer.scale, zero=getattr(layer, "zero", None), code=None,
                    group=layer.params["group_size"], perm=getattr(layer, "perm", None))
    if layer.fmt == "nf4":
        from .nf4 import NF4_CODE, block_absmax
        absmax = block_absmax(**{k: v for k, v in layer.quantized_tensors().items() if k != "packed"})
        block = layer.params["block"]
        return dict(packed=layer.packed, scale=absmax.view(layer.out_features, layer.in_features // block), zero=None,
                    code=NF4_CODE.to(absmax.device), group=block, perm=None)
    raise ValueError(f"the fused 4-bit matmul handles fmt 'int' with 4 bits and 'nf4'; got {layer.extra_repr()}")


def supports(layer) -> bool:
    if layer.fmt == "int":
        return layer.params["bits"] == 4 and layer.params["group_size"] % 32 == 0
    if layer.fmt == "nf4":
        return layer.params["block"] % 32 == 0 and layer.in_features % layer.params["block"] == 0
    return False


# Configurations QuantLinear's kernels choose from on CUDA (minillm/kernel_support/tuning.py), the first being the
# one used where nothing can be timed (CPU under the interpreter, inside a CUDA graph capture).
GEMV_LAYOUT = 1                      # words QuantLinear's GEMV reads; bench quant times both layouts
# GEMV tiles: more rows per thread (BLOCK_N / 32 / num_warps) share each converted x value, fewer
# instructions per weight (results/w4a16-sm90.json); split-K keeps enough programs for every SM
GEMV_CONFIGS = [dict(kernel="gemv", block_n=bn, split_k=sk, num_warps=nw, num_stages=ns)
                for bn, sk, nw, ns in ((128, 4, 4, 3), (64, 4, 2, 3), (64, 8, 2, 3), (128, 8, 4, 3),
                                       (256, 4, 8, 3), (128, 2, 4, 3), (32, 8, 2, 3), (64, 1, 2, 3))]
MATMUL_CONFIGS = [dict(kernel="matmul", block_m=bm, block_n=bn, split_k=sk, num_warps=nw, num_stages=ns)
                  for bm, bn, sk, nw, ns in ((16, 64, 1, 4, 2), (16, 32, 1, 4, 3), (16, 64, 4, 4, 3),
                                             (16, 128, 2, 4, 3), (32, 64, 2, 4, 3), (64, 64, 1, 4, 3),
                                             (64, 128, 1, 8, 3), (16, 32, 8, 4, 3))]
# up to MAX_GEMV_ROWS rows both kernels compete: the GEMV first (the untimed default), then tensor cores
DECODE_CONFIGS = GEMV_CONFIGS + [c for c in MATMUL_CONFIGS if c["block_m"] == 16]


def gemv_operands(layer, layout: int = GEMV_LAYOUT) -> dict:
    """operands(layer) for the GEMV: its words in `layout`, scales / zeros transposed to (ng, N) memory (a
    tile's BLOCK_N scales are then one contiguous read); made once per device and weights, cached on the layer."""
    key = (str(layer.packed.device), layer.packed.data_ptr(), layout)
    cache = layer.__dict__.setdefault("_gemv_packs", {})
    if key not in cache:
        if layer.packed.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA graph capture reached a 4-bit layer whose GEMV words do not exist yet (a "
                               "capture records kernels without running them): call the model once before capturing")
        cache.clear()                                                # weights moved or replaced: rebuild
        ops = operands(layer)
        column_major = lambda t: None if t is None else t.t().contiguous().t()   # (N, ng), strides (1, N)
        cache[key] = dict(words=gemv_words(ops["packed"], ops["group"], layout), scale=column_major(ops["scale"]),
                          zero=column_major(ops["zero"]), code=ops["code"], group=ops["group"], perm=ops["perm"],
                          layout=layout)
    return cache[key]


def _matmul_runner(x2: torch.Tensor, ops: dict):
    """run(config) of the tensor-core kernel on operands(layer) (scales and zeros in their stored layout)."""
    from kernels.w4a16 import w4a16_matmul

    zero = ops["zero"]
    if zero is not None and zero.stride() != ops["scale"].stride():
        zero = zero.contiguous()
    scale = ops["scale"].contiguous()
    return lambda config: w4a16_matmul(x2, ops["packed"], scale, zero, ops["code"], group=ops["group"],
                                       **_kernel_args(config))


def _kernel_args(config: dict) -> dict:
    return {k: v for k, v in config.items() if k != "kernel"}


def w4a16_linear(x: torch.Tensor, layer) -> torch.Tensor:
    """QuantLinear forward with the fused Triton kernels: x (..., in) -> (..., out). Up to
    kernels.w4a16_gemv.MAX_GEMV_ROWS rows of x, choose_config times the split-K GEMV's configurations and
    the tensor-core kernel's (BLOCK_M = 16) against each other; above, the tensor-core kernel's. The
    configuration used is left in layer._w4a16_config (its "kernel": "gemv" or "matmul")."""
    from kernels.w4a16_gemv import MAX_GEMV_ROWS, w4a16_gemv

    x2 = x.reshape(-1, x.shape[-1])                                  # (M, K)
    M, K = x2.shape
    decode = M <= MAX_GEMV_ROWS
    ops = gemv_operands(layer) if decode else operands(layer)
    if ops["perm"] is not None:                                      # act-order codes: permute x instead of W
        x2 = x2[:, ops["perm"].long()]
    x2 = x2.contiguous()
    mode = "nf4" if ops["code"] is not None else "int-zero" if ops["zero"] is not None else "int-sym"
    key = (M, layer.out_features, K, ops["group"], mode, str(x2.dtype), str(x2.device))
    if decode:
        matmul_runs = []                                             # built on first use: NF4's scales cost

        def run(config):
            if config["kernel"] == "matmul":
                if not matmul_runs:
                    matmul_runs.append(_matmul_runner(x2, operands(layer)))
                return matmul_runs[0](config)
            return w4a16_gemv(x2, ops["words"], ops["scale"], ops["zero"], ops["code"], group=ops["group"],
                              layout=ops["layout"], **_kernel_args(config))
        config = choose_config(("decode", *key), DECODE_CONFIGS, run)
    else:
        run = _matmul_runner(x2, ops)
        config = choose_config(("matmul", *key), MATMUL_CONFIGS, run)
    y = run(config)
    layer.__dict__["_w4a16_config"] = config
    if layer.bias is not None:
        y = y + layer.bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], -1)
