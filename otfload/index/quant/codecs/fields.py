"""Bit fields packed into wider words, unpacked on the devices for a packed codec (``int``, ``e2m1``).

On the host each packed codec unpacks in its own module (:func:`~.packed_int.unpack_ints`,
:func:`~.e2m1.fp4_values`): fused with the decode, only the box's fields, in a single pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def unpack_fields(words: jax.Array, bits: int, pack_axis: int, order: tuple[int, ...] | None = None) -> jax.Array:
    """The unsigned ``bits``-bit fields of ``words``, lowest bits first, along ``pack_axis`` (negative),
    which grows by the fields per word; ``order``: element ``j`` of each word is its field ``order[j]``
    (AWQ's interleave)."""
    width = words.dtype.itemsize * 8
    per = width // bits
    unsigned = jnp.dtype(f"uint{width}")
    data = jax.lax.bitcast_convert_type(words, unsigned) if words.dtype != unsigned else words
    axis = words.ndim + pack_axis
    shifts = (jnp.arange(per, dtype=unsigned) * bits).reshape((per,) + (1,) * (words.ndim - axis - 1))
    fields = (jnp.expand_dims(data, axis + 1) >> shifts) & jnp.asarray((1 << bits) - 1, unsigned)
    if order is not None:
        fields = jnp.take(fields, jnp.asarray(order), axis=axis + 1)
    return fields.reshape((*words.shape[:axis], words.shape[axis] * per, *words.shape[axis + 1 :]))
