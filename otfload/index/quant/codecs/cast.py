"""``cast``: numbers stored one per element in a numeric dtype, widened to float32.

FP8 and INT8 codes, BF16/F16/F32/FP8 scales, zero points stored unpacked, global scales. Widening
is exact, so the host and the device give the same bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from otfload.index.quant.codecs.codec import Codec

FLOAT32 = np.dtype(np.float32)


@functools.cache
def byte_table(dtype: np.dtype) -> np.ndarray:
    """The float32 value of each of the 256 byte codes of a one-byte dtype."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(FLOAT32)


def cast_values(values: np.ndarray, bits: int = 0, add: int = 0) -> np.ndarray:
    """Float32 ``values`` plus ``add`` (``bits`` does not apply): one-byte dtypes (FP8, int8) through
    a 256-entry table, 3x faster than ``astype`` (measured)."""
    out = byte_table(values.dtype)[values.view(np.uint8)] if values.dtype.itemsize == 1 else values.astype(FLOAT32)
    if add:
        out += add
    return out


def cast_values_jax(values: jax.Array, bits: int = 0, add: int = 0) -> jax.Array:
    """:func:`cast_values` on the devices."""
    out = values.astype(jnp.float32)
    return out + jnp.float32(add) if add else out


CODEC = Codec("cast", numpy=cast_values, jax=cast_values_jax)
