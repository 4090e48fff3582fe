"""``e2m1``: FP4 codes (MXFP4, NVFP4), 4-bit fields, sign bit 3, values ``0, .5, 1, 1.5, 2, 3, 4, 6``.

Stored two per byte, the **low nibble first** (element ``2i`` in bits 0-3 of byte ``i``).
``add`` does not apply.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from otfload.index.quant.codecs.codec import Codec

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
FP4_BITS = 4


def e2m1_values(fields: np.ndarray, bits: int = FP4_BITS, add: int = 0) -> np.ndarray:
    """Float32 values of unpacked FP4 E2M1 fields."""
    values: np.ndarray = E2M1_VALUES[fields]
    return values


def e2m1_values_jax(fields: jax.Array, bits: int = FP4_BITS, add: int = 0) -> jax.Array:
    """:func:`e2m1_values` on the devices."""
    return jnp.asarray(E2M1_VALUES)[fields.astype(jnp.int32)]


def fp4_values(packed: np.ndarray) -> np.ndarray:
    """Float32 values of FP4 E2M1 codes packed two per byte; the last axis doubles."""
    packed = np.asarray(packed, np.uint8)
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.float32)
    out[..., 0::2] = e2m1_values(packed & 0x0F)
    out[..., 1::2] = e2m1_values(packed >> 4)
    return out


CODEC = Codec("e2m1", numpy=e2m1_values, jax=e2m1_values_jax)
