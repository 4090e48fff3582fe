"""Quantized weights kept packed on the devices, and :func:`dequantize`, their pure-JAX decoder.

``from_pretrained(..., quantized="keep")`` places each quantized weight as a
:class:`QuantizedArray`: its stored codes (uint8 / float8 / int8 / int32, as stored) and scales (plus
zero points and a global scale where the format has them) as sibling device arrays. Every part
has the weight's rank; one element of a part covers ``block[d]`` elements of the weight along each
of its trailing axes (:mod:`otfload.index.quant.parts`), and leading axes (scanned layers, experts)
are the weight's own. The static metadata counts axes from the end, so slicing the leading axes
(``jax.lax.scan`` over layers, ``a[i]``) gives a valid :class:`QuantizedArray` of one layer.

:func:`dequantize` reproduces the default mode's values bit for bit: each part becomes float32 by its
codec's JAX decoder, the twin of the numpy one the default mode reads with
(:mod:`otfload.index.quant.codecs`: FP8 and FP4 tables, integer fields minus their offset, E8M0
exponents), zero points are subtracted, scales
(divided, or for ModelOpt multiplied, by the global scale) multiply block by block in float32, and
the result is cast to the leaf dtype — the operations of
:meth:`~otfload.index.quant.tensor.QuantizedTensor.decode`, in the same order.
A :class:`QuantizedArray` is a :class:`~otfload.models.weights.StoredWeight`: the models
materialize it one layer at a time inside ``run_layers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import EllipsisType

import jax
import jax.numpy as jnp
import numpy as np

from otfload.index.quant.codecs import CODECS
from otfload.index.quant.codecs.fields import unpack_fields
from otfload.index.quant.parts import StoredPart

ROLES = ("codes", "scale", "zero_point", "global_scale")
# What ``QuantizedArray.__getitem__`` accepts for one leading axis (or a tuple of them).
AxisIndex = int | slice | jax.Array | np.ndarray | EllipsisType | None


@dataclass(frozen=True)
class PartLayout:
    """How one part maps onto the weight's trailing axes (static: hashable, layer-independent).

    ``block`` and ``pack_axis`` count from the end (``pack_axis`` is negative); ``codec`` is a key
    of :data:`otfload.index.quant.codecs.CODECS`; ``multiplies``: a global scale that multiplies the
    scales (ModelOpt's ``weight_scale_2``) rather than dividing them; ``order``: element ``j`` of each
    packed word is its field ``order[j]`` (AWQ); ``add`` is added to the values (GPTQ v1 zero points).
    """

    block: tuple[int, ...]
    codec: str
    bits: int = 0
    pack_axis: int | None = None
    field: int = 1
    multiplies: bool = False
    order: tuple[int, ...] | None = None
    add: int = 0

    @classmethod
    def of_part(cls, part: StoredPart, block: tuple[int, ...], pack_axis: int | None) -> PartLayout:
        """The layout of the stored ``part`` once it is a leaf: ``block`` and ``pack_axis`` (counted
        from the start, as the plan carries them through the hooks), its decoding as stored."""
        return cls(block, part.codec, part.bits, None if pack_axis is None else pack_axis - len(block), part.field,
                   part.multiplies, part.order, part.add)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class QuantizedArray:
    """A quantized weight of trailing ``shape`` placed packed; ``dequantize()`` gives the dense kernel.

    ``codes``/``scale``/``zero_point``/``global_scale`` are device arrays (None when the format has
    no such part); the rest is static metadata.
    """

    codes: jax.Array
    scale: jax.Array | None
    zero_point: jax.Array | None
    global_scale: jax.Array | None
    shape_tail: tuple[int, ...] = dataclasses.field(metadata={"static": True})
    dtype_name: str = dataclasses.field(metadata={"static": True})
    layouts: tuple[tuple[str, PartLayout], ...] = dataclasses.field(metadata={"static": True})
    storage: str = dataclasses.field(default="", metadata={"static": True})

    @property
    def dtype(self) -> np.dtype:
        return jnp.dtype(self.dtype_name)

    @property
    def shape(self) -> tuple[int, ...]:
        """The dense weight's shape: the codes' leading axes, then the trailing weight axes."""
        lead = self.codes.shape[: self.codes.ndim - len(self.shape_tail)]
        return (*lead, *self.shape_tail)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of every placed part (the stored bytes, not the dense weight's)."""
        return sum(a.nbytes for a in self.parts().values())

    @classmethod
    def from_parts(
        cls, parts: Mapping[str, jax.Array], shape_tail: tuple[int, ...], dtype_name: str,
        layouts: tuple[tuple[str, PartLayout], ...], storage: str,
    ) -> QuantizedArray:
        """The weight whose placed parts are ``parts`` (by role, see :data:`ROLES`; codes required):
        the inverse of :meth:`parts`."""
        return cls(parts["codes"], parts.get("scale"), parts.get("zero_point"), parts.get("global_scale"),
                   shape_tail, dtype_name, layouts, storage)

    def parts(self) -> dict[str, jax.Array]:
        return {role: getattr(self, role) for role in ROLES if getattr(self, role) is not None}

    def materialize(self) -> jax.Array:
        return dequantize(self)

    def __getitem__(self, key: AxisIndex | tuple[AxisIndex, ...]) -> QuantizedArray:
        """Index the leading (layer / expert) axes only: ``w[i]`` is layer ``i``'s weight."""
        index = key if isinstance(key, tuple) else (key,)
        lead = self.codes.ndim - len(self.shape_tail)
        if len(index) == 1 and index[0] is Ellipsis:
            return self
        if len([i for i in index if i is not None]) > lead or any(i is Ellipsis or i is None for i in index):
            raise IndexError(f"a QuantizedArray indexes only its {lead} leading axes, got {index}")
        sliced: QuantizedArray = jax.tree.map(lambda a: a[index], self)
        return sliced


def _part_layout(q: QuantizedArray, role: str) -> PartLayout:
    return dict(q.layouts)[role]


def _values(part: jax.Array, layout: PartLayout) -> tuple[jax.Array, tuple[int, ...]]:
    """The part's float32 values (by its codec's JAX decoder) and the block each value covers."""
    codec = CODECS[layout.codec]
    if layout.pack_axis is None:
        return codec.jax(part, layout.bits, layout.add), layout.block
    block = list(layout.block)
    block[len(block) + layout.pack_axis] = layout.field
    fields = unpack_fields(part, layout.bits, layout.pack_axis, layout.order)
    return codec.jax(fields, layout.bits, layout.add), tuple(block)


def _expand(values: jax.Array, block: tuple[int, ...], shape: tuple[int, ...]) -> jax.Array:
    """One value per block expanded to the trailing ``shape`` (axes of one block stay 1: broadcast)."""
    n = len(shape)
    for i, (b, d) in enumerate(zip(block, shape, strict=True)):
        axis = values.ndim - n + i
        if values.shape[axis] == 1 or (b == 1 and values.shape[axis] == d):
            continue
        if b > 1:
            values = jnp.repeat(values, b, axis=axis)
        values = jax.lax.slice_in_dim(values, 0, d, axis=axis)
    return values


def dequantize(leaf: QuantizedArray) -> jax.Array:
    """The dense weight of ``leaf`` in its dtype: exactly the values ``quantized="dequantize"`` loads.

    Pure JAX (jit-able, differentiable in the scales); works on any slice of the leading axes.
    """
    shape = leaf.shape_tail
    values, block = _values(leaf.codes, _part_layout(leaf, "codes"))
    values = _expand(values, block, shape)
    if leaf.zero_point is not None:
        zero, zblock = _values(leaf.zero_point, _part_layout(leaf, "zero_point"))
        values = values - _expand(zero, zblock, shape)
    if leaf.scale is not None:
        scale, sblock = _values(leaf.scale, _part_layout(leaf, "scale"))
        if leaf.global_scale is not None:
            layout = _part_layout(leaf, "global_scale")
            value = _values(leaf.global_scale, layout)[0]
            scale = scale * value if layout.multiplies else scale / value
        values = values * _expand(scale, sblock, shape)
    return values.astype(leaf.dtype)


__all__ = ["PartLayout", "QuantizedArray", "dequantize"]
