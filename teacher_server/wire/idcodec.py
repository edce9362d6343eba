"""Compact wire encoding of top-k token ids: Elias-Fano, one fixed-width record per row.

A top-k row is a set of K distinct ids below the vocabulary size V. Sorted ascending, it is
Elias-Fano coded in K*L + K + ((V-1) >> L) + 1 bits with L = floor(log2(V/K)): at V=32000,
K=256 that is 287 bytes instead of 1 KiB of int32. Every row of a reply has the same K and V,
so every record has the same width and the whole [N, K] block encodes and decodes with a few
vectorised numpy calls. Decoded ids are int32 and come out ascending within each row (the
caller re-sorts rows by logprob; see protocol.canonical_order).
"""

from __future__ import annotations

import numpy as np

ID_DTYPE = np.dtype("<i4")


def low_bits(vocab_size: int, top_k: int) -> int:
    """L = floor(log2(V / K)), the number of bits stored verbatim per id (0 when K >= V/2)."""
    ratio = vocab_size // top_k
    return max(ratio.bit_length() - 1, 0)


def _widths(vocab_size: int, top_k: int) -> tuple[int, int, int]:
    """(L, bytes of the low part, bits of the unary high part) of one row."""
    low = low_bits(vocab_size, top_k)
    high_bits = top_k + ((vocab_size - 1) >> low) + 1
    return low, (top_k * low + 7) // 8, high_bits


def row_bytes(vocab_size: int, top_k: int) -> int:
    """Encoded size of one row of K ids."""
    _, low_bytes, high_bits = _widths(vocab_size, top_k)
    return low_bytes + (high_bits + 7) // 8


def encode(ids_NK: np.ndarray, vocab_size: int) -> bytes:
    """Elias-Fano code each row of `ids_NK` (distinct ids in [0, vocab_size), any order)."""
    n_rows, top_k = ids_NK.shape
    if n_rows == 0 or top_k == 0:
        return b""
    low, low_bytes, high_bits = _widths(vocab_size, top_k)
    sorted_NK = np.sort(ids_NK.astype(np.int64, copy=False), axis=1)
    # Low part: the L low bits of every id, packed row by row.
    low_NKL = (sorted_NK[:, :, None] >> np.arange(low)) & 1  # [N, K, L]
    low_packed = np.packbits(low_NKL.astype(np.uint8).reshape(n_rows, top_k * low), axis=1)
    # High part: id i sets bit (id_i >> L) + i of a unary bit vector.
    high_NB = np.zeros((n_rows, high_bits), dtype=np.uint8)
    np.put_along_axis(high_NB, (sorted_NK >> low) + np.arange(top_k), 1, axis=1)
    high_packed = np.packbits(high_NB, axis=1)
    assert low_packed.shape[1] == low_bytes
    return np.concatenate([low_packed, high_packed], axis=1).tobytes()


def decode(buf: bytes | memoryview, n_rows: int, top_k: int, vocab_size: int) -> np.ndarray:
    """Inverse of `encode`: int32 ids [n_rows, top_k], ascending within each row.

    Raises ValueError when the buffer does not hold exactly n_rows well-formed records.
    """
    if n_rows == 0 or top_k == 0:
        return np.zeros((n_rows, top_k), dtype=np.int32)
    low, low_bytes, high_bits = _widths(vocab_size, top_k)
    width = row_bytes(vocab_size, top_k)
    raw = np.frombuffer(buf, dtype=np.uint8)
    if raw.size != n_rows * width:
        raise ValueError(f"elias_fano block has {raw.size} bytes, expected {n_rows} rows x {width}")
    rows_NW = raw.reshape(n_rows, width)
    weights_L = (1 << np.arange(low)).astype(np.int32)
    low_bits_NKL = np.unpackbits(rows_NW[:, :low_bytes], axis=1, count=top_k * low).reshape(n_rows, top_k, low)
    low_NK = low_bits_NKL.astype(np.int32) @ weights_L if low else np.zeros((n_rows, top_k), np.int32)
    high_NB = np.unpackbits(rows_NW[:, low_bytes:], axis=1, count=high_bits)
    row_idx, bit_idx = np.nonzero(high_NB)
    if row_idx.size != n_rows * top_k or np.any(row_idx.reshape(n_rows, top_k) != np.arange(n_rows)[:, None]):
        raise ValueError("elias_fano block is corrupt: a row does not hold exactly top_k ids")
    high_NK = bit_idx.reshape(n_rows, top_k) - np.arange(top_k)
    ids_NK = (high_NK << low) | low_NK
    if np.any(ids_NK >= vocab_size):
        raise ValueError("elias_fano block is corrupt: an id is outside the vocabulary")
    return ids_NK.astype(np.int32)
