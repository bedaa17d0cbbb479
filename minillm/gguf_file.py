"""Read a GGUF file: metadata, tensors, and our own dequantisation of its block formats.

The `gguf` package parses the container (header, key-values, tensor table); turning the raw
bytes of each tensor into float32 is done here, because Q4_1 and Q8_0 are the reader's first
look at block quantisation (lesson 04 builds its own int4/NF4 formats on the same idea):

    Q8_0  block of 32: fp16 scale d, 32 x int8 q            w = d * q
    Q4_0  block of 32: fp16 scale d, 16 bytes of nibbles    w = d * (q - 8)
    Q4_1  block of 32: fp16 scale d, fp16 min m, 16 bytes   w = d * q + m

In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
tests/test_gguf.py proves this is bit-for-bit equal to `gguf.quants.dequantize` on every tensor.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

QK = 32  # weights per block in Q4_0, Q4_1 and Q8_0

# ggml type ids (ggml.h): only the ones this project dequantises.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}
BLOCK_BYTES = {Q4_0: 2 + QK // 2, Q4_1: 2 + 2 + QK // 2, Q8_0: 2 + QK}


def _fp16(raw: np.ndarray) -> np.ndarray:
    """(n, 2) uint8 -> (n, 1) float32: a little-endian fp16 per row."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32) values 0..15: low nibbles first, then high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    d = _fp16(blocks[:, :2])                                   # (n, 1)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)  # (n, 32)
    return d * q


def dequantize_q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _fp16(blocks[:, :2])                                   # (n, 1)
    q = _nibbles(blocks[:, 2:])                                # (n, 32)
    return d * (q - np.float32(8))


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    d = _fp16(blocks[:, :2])                                   # (n, 1)
    m = _fp16(blocks[:, 2:4])                                  # (n, 1)
    q = _nibbles(blocks[:, 4:])                                # (n, 32)
    return d * q + m


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes (as stored) -> float32 array of `shape` (numpy order, rows last-dim major)."""
    n = int(np.prod(shape))
    if ggml_type == F32:
        return raw.reshape(-1).view(np.float32).reshape(shape).copy()
    if ggml_type == F16:
        return raw.reshape(-1).view(np.float16).astype(np.float32).reshape(shape)
    if ggml_type == BF16:
        bits = raw.reshape(-1).view(np.uint16).astype(np.uint32) << 16  # bf16 is the top half of fp32
        return bits.view(np.float32).reshape(shape)
    if ggml_type in BLOCK_BYTES:
        blocks = raw.reshape(-1).view(np.uint8).reshape(n // QK, BLOCK_BYTES[ggml_type])
        fn = {Q8_0: dequantize_q8_0, Q4_0: dequantize_q4_0, Q4_1: dequantize_q4_1}[ggml_type]
        return fn(blocks).reshape(shape)
    raise ValueError(f"GGUF tensor type {ggml_type} is not supported; supported: "
                     f"{', '.join(TYPE_NAMES.values())}")


@dataclass
class GGUFTensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]   # numpy order: (rows, cols) for a weight matrix (out_features, in_features)
    raw: np.ndarray          # the bytes as stored in the file (memory-mapped)

    def to_float32(self) -> np.ndarray:
        return dequantize(self.raw, self.ggml_type, self.shape)


@dataclass
class GGUFFile:
    path: Path
    metadata: dict = field(default_factory=dict)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)


def _field_value(f):
    """A GGUF key-value as a Python value (str, number, or list of them)."""
    from gguf import GGUFValueType

    if f.types and f.types[0] == GGUFValueType.ARRAY:
        if f.types[-1] == GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
        return [f.parts[i].tolist()[0] for i in f.data]
    if f.types and f.types[0] == GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]].tolist()[0]


def read_gguf(path: str | Path) -> GGUFFile:
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = GGUFReader(str(path))
    out = GGUFFile(path=path)
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out.metadata[key] = _field_value(f)
    for t in reader.tensors:
        # GGUF lists dims fastest-first; numpy order is the reverse.
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        out.tensors[t.name] = GGUFTensor(t.name, int(t.tensor_type), shape, t.data)
    return out
