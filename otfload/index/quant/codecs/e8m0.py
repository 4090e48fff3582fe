"""``e8m0``: one byte ``s`` standing for ``2**(s - 127)`` (OCP microscaling scales, MXFP4); ``s = 255``
is NaN. ``bits`` and ``add`` do not apply."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from otfload.index.quant.codecs.codec import Codec

E8M0_BIAS = 127
E8M0_NAN = 255
FLOAT32_MANTISSA_BITS = 23
# E8M0 byte 0 is 2**-127, a float32 subnormal: only the top mantissa bit set.
E8M0_ZERO_BITS = 1 << (FLOAT32_MANTISSA_BITS - 1)


def e8m0_values(scales: np.ndarray, bits: int = 0, add: int = 0) -> np.ndarray:
    """Float32 values of E8M0 scale bytes (``2**(s - 127)``, NaN for 255)."""
    s = np.asarray(scales, np.uint8)
    exponent = np.where(s == E8M0_NAN, 0, s.astype(np.int32) - E8M0_BIAS)
    out = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    out[s == E8M0_NAN] = np.nan
    return out


def e8m0_values_jax(scales: jax.Array, bits: int = 0, add: int = 0) -> jax.Array:
    """:func:`e8m0_values` on the devices, built from the float32 bits (exact, subnormal 2**-127
    included)."""
    s = scales.astype(jnp.uint32)
    exponent_bits = jnp.where(s == 0, jnp.uint32(E8M0_ZERO_BITS), s << FLOAT32_MANTISSA_BITS)
    values = jax.lax.bitcast_convert_type(exponent_bits, jnp.float32)
    return jnp.where(s == E8M0_NAN, jnp.float32(jnp.nan), values)


CODEC = Codec("e8m0", numpy=e8m0_values, jax=e8m0_values_jax)
