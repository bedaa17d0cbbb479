"""Character ranges as UTF-8 byte-range sequences, so a DFA over bytes can match characters.

A regex speaks in characters (code points); the tokenizer speaks in bytes (byte-level BPE: a
token may hold half of a character). We compile each character class into byte sequences:

    [a-z]          -> [61-7A]                              one byte
    [\u00e9-\u00ff] -> [C3][A9-BF]                          two bytes
    [^"]           -> [00-21] | [23-7F] | [C2-DF][80-BF] | [E0][A0-BF][80-BF] | ...

The split follows UTF-8's structure: first by encoded length (1-4 bytes), then, within one
length, into pieces whose every continuation byte spans a full or a shared range, so that each
piece is a plain sequence of byte ranges (RE2 and Rust's regex-syntax do the same).
"""
from __future__ import annotations

MAX_CODE_POINT = 0x10FFFF
SURROGATES = (0xD800, 0xDFFF)          # not characters: UTF-8 cannot encode them
LENGTH_LIMITS = (0x7F, 0x7FF, 0xFFFF, MAX_CODE_POINT)   # largest code point of a 1..4-byte encoding


def utf8_sequences(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """Code points lo..hi (inclusive) -> byte-range sequences whose union matches exactly their UTF-8."""
    out = []
    for a, b in _without_surrogates(lo, hi):
        start = a
        for limit in LENGTH_LIMITS:            # split where the encoded length changes
            if start > b:
                break
            if start <= limit:
                end = min(b, limit)
                out += _same_length(start, end)
                start = end + 1
    return out


def _without_surrogates(lo: int, hi: int) -> list[tuple[int, int]]:
    s_lo, s_hi = SURROGATES
    if hi < s_lo or lo > s_hi:
        return [(lo, hi)]
    return [(a, b) for a, b in ((lo, s_lo - 1), (s_hi + 1, hi)) if a <= b]


def _same_length(lo: int, hi: int) -> list[list[tuple[int, int]]]:
    """lo..hi share an encoded length. Recursively split until each piece differs only in
    trailing bytes that sweep their whole range (then every byte position is an independent range)."""
    a, b = chr(lo).encode(), chr(hi).encode()
    if len(a) == 1:
        return [[(a[0], b[0])]]
    for i in range(1, len(a)):                 # i = number of trailing continuation bytes considered
        mask = (1 << (6 * i)) - 1
        if lo & ~mask != hi & ~mask:           # lo and hi differ above these i trailing bytes
            if lo & mask != 0:                 # lo does not start a full block: peel it off
                return _same_length(lo, lo | mask) + _same_length((lo | mask) + 1, hi)
            if hi & mask != mask:              # hi does not end a full block
                return _same_length(lo, (hi & ~mask) - 1) + _same_length(hi & ~mask, hi)
    return [[(x, y) for x, y in zip(a, b)]]
