"""Round-to-nearest (RTN) integer quantisation in groups, and the bit packing it is stored in.

A weight W (out, in) is cut into groups of `group_size` consecutive input columns of one row.
Each group gets a scale s (and, when asymmetric, an integer zero point z); b = bits:

    symmetric:   s = max|w| / (2^(b-1) - 1)          z = 2^(b-1)  (a constant: not stored)
    asymmetric:  s = (max - min) / (2^b - 1)         z = round(-min / s)
    codes:       q = clamp(round(w / s) + z, 0, 2^b - 1)          unsigned b-bit integers
    dequantise:  w ~= (q - z) * s

The asymmetric range always includes 0 (min <= 0 <= max, as GPTQ does), so z is a valid code and
an exact zero weight stays exactly zero. That also makes a short last group easy: SmolLM2's
in_features 576 = 4 x 128 + 64, so with group_size 128 each row has four full groups and one
of 64. The row is zero-padded to whole groups, which changes neither max|w| nor min(w, 0) / max(w, 0). Scales are stored in fp16 and the codes are computed
with the *rounded* scale, so dequantisation reproduces exactly what was measured.
GPTQ and AWQ produce weights in this same format; only how the codes are chosen differs.

Packing: 4-bit codes go two per byte, the first element in the high nibble;
3-bit codes go eight per three bytes (24 bits, first element in the lowest bits).
"""
from __future__ import annotations

import torch

SUPPORTED_BITS = (3, 4)
FP16_TINY = torch.finfo(torch.float16).tiny   # smallest normal fp16: scales are clamped to it


# ---- packing ---------------------------------------------------------------------------------

def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (..., n) with values < 2^bits -> uint8 (..., n * bits / 8)."""
    # BEGIN SOLUTION nf4_rtn
    if bits == 4:
        if codes.shape[-1] % 2:
            raise ValueError(f"4-bit packing needs an even number of values per row, got {codes.shape[-1]}")
        c = codes.to(torch.uint8)
        return (c[..., 0::2] << 4) | c[..., 1::2]                   # (..., n/2): high nibble first
    if bits == 3:
        if codes.shape[-1] % 8:
            raise ValueError(f"3-bit packing needs a multiple of 8 values per row, got {codes.shape[-1]}")
        c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)  # (..., n/8, 8)
        shifts = torch.arange(0, 24, 3, device=codes.device, dtype=torch.int32)
        word = (c << shifts).sum(-1, dtype=torch.int32)              # (..., n/8): 24 bits used
        three = torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1)  # (..., n/8, 3)
        return three.to(torch.uint8).flatten(-2)
    raise ValueError(f"bits = {bits} cannot be packed; allowed: {SUPPORTED_BITS}")
    # END SOLUTION


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack: uint8 (..., m) -> uint8 codes (..., m * 8 / bits)."""
    # BEGIN SOLUTION nf4_rtn
    if bits == 4:
        high, low = packed >> 4, packed & 0xF                        # (..., m) each
        return torch.stack((high, low), dim=-1).flatten(-2)          # (..., 2m)
    if bits == 3:
        b = packed.to(torch.int32).reshape(*packed.shape[:-1], -1, 3)  # (..., m/3, 3)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)       # (..., m/3)
        shifts = torch.arange(0, 24, 3, device=packed.device, dtype=torch.int32)
        return ((word[..., None] >> shifts) & 0x7).to(torch.uint8).flatten(-2)  # (..., 8m/3)
    raise ValueError(f"bits = {bits} cannot be unpacked; allowed: {SUPPORTED_BITS}")
    # END SOLUTION


# ---- the quantiser ---------------------------------------------------------------------------

def check_bits(bits) -> int:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits = {bits!r} is not supported for integer group quantisation; allowed: {SUPPORTED_BITS}")
    return bits


def scale_zero(w: torch.Tensor, bits: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each row of w (..., G) -> s (...), z (...) as float32.
    s is already rounded to fp16, the precision it is stored in."""
    # BEGIN SOLUTION nf4_rtn
    w = w.float()
    maxq = 2 ** bits - 1
    if symmetric:
        s = w.abs().amax(-1) / (2 ** (bits - 1) - 1)
        s = s.clamp(min=FP16_TINY).half().float()
        return s, torch.full_like(s, 2 ** (bits - 1))
    lo = w.amin(-1).clamp(max=0)
    hi = w.amax(-1).clamp(min=0)
    s = ((hi - lo) / maxq).clamp(min=FP16_TINY).half().float()
    z = torch.round(-lo / s).clamp(0, maxq)
    return s, z
    # END SOLUTION


def quantize_codes(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes of w (..., G) for per-row s, z (...) -> float tensor of integers in [0, 2^bits - 1]."""
    # BEGIN SOLUTION nf4_rtn
    return torch.clamp(torch.round(w.float() / s[..., None]) + z[..., None], 0, 2 ** bits - 1)
    # END SOLUTION


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
        raise ValueError(f"group_size = {group_size!r} is invalid; allowed: a positive integer (32, 64, 128 are usual)")
    return group_size


def grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """(..., I) -> (..., ceil(I / G), G), zero-padded at the end of each row."""
    pad = (-w.shape[-1]) % group_size
    w = torch.nn.functional.pad(w, (0, pad))
    return w.reshape(*w.shape[:-1], -1, group_size)


def per_column(t: torch.Tensor, group_size: int, in_features: int) -> torch.Tensor:
    """Per-group values (O, ng) -> per-column values (O, in_features)."""
    return t.repeat_interleave(group_size, dim=1)[:, :in_features]


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = False) -> dict:
    """RTN: W (out, in) -> {"packed": uint8, "scale": fp16 (out, ng), "zero": uint8 (out, ng) if asymmetric},
    ng = ceil(in / group_size)."""
    check_bits(bits)
    check_group_size(group_size)
    out_f, in_f = w.shape
    groups = grouped(w.float(), group_size)                              # (O, ng, G)
    s, z = scale_zero(groups, bits, symmetric)                           # (O, ng) each
    codes = quantize_codes(groups, s, z, bits).reshape(out_f, -1)[:, :in_f]  # (O, I)
    return encode(codes, s, z, bits, symmetric)


def encode(codes: torch.Tensor, s: torch.Tensor, z: torch.Tensor, bits: int, symmetric: bool,
           perm: torch.Tensor | None = None) -> dict:
    """Integer codes (out, in), scales and zeros (out, in/G) -> the stored tensors.
    perm (GPTQ act-order): column order the codes are in; dequantise puts columns back."""
    tensors = {"packed": pack(codes.to(torch.uint8), bits), "scale": s.half()}
    if not symmetric:
        tensors["zero"] = z.to(torch.uint8)
    if perm is not None:
        tensors["perm"] = perm.to(torch.int32)
    return tensors


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None,
               perm: torch.Tensor | None = None, *, bits: int, group_size: int) -> torch.Tensor:
    """Stored tensors -> W (out, in) float32."""
    codes = unpack(packed, bits)                                         # (O, I) uint8
    in_f = codes.shape[1]
    # BEGIN SOLUTION nf4_rtn
    z = zero.float() if zero is not None else torch.full(scale.shape, 2.0 ** (bits - 1), device=scale.device)
    groups = grouped(codes, group_size).float()                          # (O, ng, G)
    w = ((groups - z[..., None]) * scale.float()[..., None]).flatten(1)[:, :in_f]  # (O, I)
    # END SOLUTION
    if perm is not None:                                                 # codes are in act-order: undo it
        w = w[:, torch.argsort(perm.long())]
    return w


def fake_quantize(w: torch.Tensor, bits: int = 4, group_size: int = 128, symmetric: bool = False) -> torch.Tensor:
    """dequantize(quantize(w)) without packing: what the model will compute with, in float32."""
    in_f = w.shape[-1]
    groups = grouped(w.float(), group_size)                              # (..., ng, G)
    s, z = scale_zero(groups, bits, symmetric)
    q = quantize_codes(groups, s, z, bits)
    return ((q - z[..., None]) * s[..., None]).flatten(-2)[..., :in_f]
