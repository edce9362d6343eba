"""The wire's 16-bit hidden states (teacher.output=hidden): bfloat16 or float16, decoded to float32.

numpy has no bfloat16: a bf16 value travels as the top 16 bits of its float32 (rounded to nearest,
ties to even), little-endian, and decodes by shifting them back, exactly.
"""

from __future__ import annotations

import numpy as np

HIDDEN_DTYPES = ("bfloat16", "float16")
HIDDEN_ITEMSIZE = 2
_BF16_HALF_ULP = np.uint32(0x7FFF)


def round_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded to `dtype`'s precision (still float32): what the wire will carry."""
    return decode(encode(values, dtype), dtype, values.shape[-1] if values.ndim else 1).reshape(values.shape)


def encode(values: np.ndarray, dtype: str) -> bytes:
    """float32 [N, H] -> the wire's 2 bytes per value."""
    values = np.ascontiguousarray(values, dtype="<f4")
    if dtype == "float16":
        return values.astype("<f2").tobytes()
    if dtype != "bfloat16":
        raise ValueError(f"hidden dtype {dtype!r} not in {HIDDEN_DTYPES}")
    bits = values.view("<u4")
    # Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then drop the low 16 bits.
    rounded = (bits + _BF16_HALF_ULP + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return rounded.astype("<u2").tobytes()


def decode(frame: bytes | memoryview, dtype: str, hidden_size: int) -> np.ndarray:
    """The wire's bytes -> float32 [N, hidden_size]."""
    if dtype == "float16":
        return np.frombuffer(frame, dtype="<f2").reshape(-1, hidden_size).astype(np.float32)
    if dtype != "bfloat16":
        raise ValueError(f"hidden dtype {dtype!r} not in {HIDDEN_DTYPES}")
    bits = np.frombuffer(frame, dtype="<u2").astype("<u4") << np.uint32(16)
    return bits.view("<f4").reshape(-1, hidden_size)
