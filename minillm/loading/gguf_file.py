"""Read a GGUF file: metadata, tensors, and our own dequantisation of its block formats.

The container is parsed here too (read_gguf): a header, key-values, a tensor table, then the
tensor bytes, aligned; the `gguf` package is the peer it is tested against (its reader builds a
numpy view per field part, slow for a large vocabulary; this one unpacks the fields directly). Turning the raw bytes of each tensor into float32 is done here because Q4_1
and Q8_0 are the reader's first look at block quantisation (lesson 04 builds its own int4/NF4
formats on the same idea):

    Q8_0  block of 32: fp16 scale d, 32 x int8 q            w = d * q
    Q4_0  block of 32: fp16 scale d, 16 bytes of nibbles    w = d * (q - 8)
    Q4_1  block of 32: fp16 scale d, fp16 min m, 16 bytes   w = d * q + m

In a 4-bit block, byte j holds element j in its low nibble and element j + 16 in its high nibble.
tests/loading/test_gguf.py proves this is bit-for-bit equal to `gguf.quants.dequantize` on every tensor,
and the metadata and tensor table equal to `gguf.GGUFReader`'s.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

QK = 32  # weights per block in Q4_0, Q4_1 and Q8_0

# ggml type ids (ggml.h): only the ones this project dequantises.
F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q8_0: "Q8_0", BF16: "BF16"}
BLOCK_BYTES = {Q4_0: 2 + QK // 2, Q4_1: 2 + 2 + QK // 2, Q8_0: 2 + QK}
ELEMENT_BYTES = {F32: 4, F16: 2, BF16: 2}

# Key-value types of the GGUF container (gguf.md of ggml): scalars as struct formats, little-endian.
KV_STRING, KV_ARRAY = 8, 9
KV_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
DEFAULT_ALIGNMENT = 32


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


class _Cursor:
    """Reads the container's little-endian fields from a memory-mapped file, front to back."""

    def __init__(self, buf: mmap.mmap, pos: int):
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str):
        value, = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int):
        """One key-value's value of type `kind`: a number, a bool, a str, or a list of them."""
        if kind == KV_STRING:
            return self.string()
        if kind == KV_ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in KV_SCALARS and item != 7:                # numbers: one numpy read, not `count` unpacks
                dtype = np.dtype(KV_SCALARS[item])
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos += count * dtype.itemsize
                return values
            return [self.value(item) for _ in range(count)]
        if kind in KV_SCALARS:
            return self.scalar(KV_SCALARS[kind])
        raise ValueError(f"GGUF key-value type {kind} at byte {self.pos} is not one of the format's "
                         f"types 0-12: the file is damaged or not GGUF")


def _tensor_bytes(ggml_type: int, shape: tuple[int, ...]) -> int:
    n = int(np.prod(shape))
    if ggml_type in BLOCK_BYTES:
        return n // QK * BLOCK_BYTES[ggml_type]
    return n * ELEMENT_BYTES.get(ggml_type, 0)        # 0: a type we cannot size; dequantize says so


def read_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata (key -> value) and tensors (name -> GGUFTensor over the mapped bytes)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)   # stays mapped after the file closes
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    try:
        return _parse(path, buf)
    except (struct.error, ValueError) as e:            # a field or a tensor runs past the end of the file
        if "GGUF" in str(e):
            raise
        raise ValueError(f"{path}: the GGUF file is truncated or damaged ({e})") from None


def _parse(path: Path, buf: mmap.mmap) -> GGUFFile:
    cur = _Cursor(buf, pos=4)                              # past the magic
    version, n_tensors, n_kv = cur.scalar("<I"), cur.scalar("<Q"), cur.scalar("<Q")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}; supported: 2, 3")
    out = GGUFFile(path=path)
    for _ in range(n_kv):
        key = cur.string()
        out.metadata[key] = cur.value(cur.scalar("<I"))
    table = []
    for _ in range(n_tensors):
        name, n_dims = cur.string(), cur.scalar("<I")
        dims = [cur.scalar("<Q") for _ in range(n_dims)]
        table.append((name, tuple(reversed(dims)), cur.scalar("<I"), cur.scalar("<Q")))  # numpy order
    align = out.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    start = -(-cur.pos // align) * align                  # the tensor data begins on an aligned offset
    for name, shape, ggml_type, offset in table:
        raw = np.frombuffer(buf, np.uint8, _tensor_bytes(ggml_type, shape), start + offset)  # a view: no copy
        out.tensors[name] = GGUFTensor(name, ggml_type, shape, raw)
    return out
