"""The stored parts of a quantized tensor, each described in the coordinates of the float tensor.

Keeping a weight quantized (``quantized="keep"``) places its stored parts (codes, scales, zero
points, global scale) as they are, so each part is described as a *blocked view* of the float
tensor it stands for: after an optional reshape and permutation of the stored bytes (``view``,
``perm``), the part has the float tensor's rank and one element of it covers ``block[d]``
consecutive elements along each axis ``d``. That one description serves every layout:

- plain codes (FP8, int8): block 1 everywhere;
- codes packed ``k`` per word along the last axis (int4 in int32: 8; FP4 in uint8: 2): block ``k``
  on that axis, and ``packing`` says how to unpack;
- a scale grid: the quantization block (per tensor: the whole shape; per row; per group; 128x128);
- compressed-tensors zero points, packed ``k`` per int32 along the grid's rows: the scale block
  times ``k`` on axis -2;
- a global scale: one block as large as the tensor;
- MXFP4 blocks ``[..., out, in/32, 16]`` U8: viewed as ``[..., out, in/2]`` and transposed to
  ``[..., in/2, out]`` (block 2 along ``in``), its E8M0 scales ``[..., out, in/32]`` transposed
  to ``[..., in/32, out]`` (block 32 along ``in``).

- GPTQ / AWQ parts, stored ``[in, out]``-major: each transposed (``perm``) to the weight's
  ``[out, in]``, then as above (AWQ's codes and every zero point packed along the rows, in AWQ's
  interleaved ``order``; GPTQ v1 zero points stored minus one: ``add`` 1).

The plan carries these blocks through the mapping hooks (:mod:`otfload.plan.keep`), and
:func:`otfload.quantized.dequantize` expands them back, with the same arithmetic as
:meth:`~otfload.index.quant.tensor.QuantizedTensor.decode`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from otfload.index.header import TensorInfo
from otfload.index.quant.tensor import (
    MX_BLOCK,
    MX_BLOCK_BYTES,
    BlockScales,
    IndexedScales,
    Mxfp4Codes,
    PackedFp4Codes,
    PackedIntCodes,
    PlainCodes,
    QuantizedTensor,
)

# How a part's values become float32: ``cast`` (astype: FP8, BF16, F32 scales, int8 codes,
# unpacked zero points), ``e8m0`` (one byte ``s`` is ``2**(s-127)``), and for packed parts ``int``
# (``bits``-bit unsigned fields minus ``2**(bits-1)``) or ``e2m1`` (FP4 codes).
CODECS = ("cast", "e8m0", "int", "e2m1")
FP4_BITS = 4
# Non-numpy dtypes a part may be stored in (ml_dtypes; JAX arrays hold them as they are).
ML_DTYPES = frozenset({"bfloat16"})


@dataclass(frozen=True)
class StoredPart:
    """One stored tensor of a quantized weight, as a blocked view of the weight (see module doc).

    ``pack_axis`` (packed parts only) is the axis along which ``bits``-bit fields are packed into
    each element, lowest bits first; each field covers ``field`` elements of the weight along it
    (1 for codes, the scale block's rows for packed zero points); ``order``: element ``j`` of each
    word is its field ``order[j]`` (AWQ). ``multiplies`` (global scales only): the value multiplies
    the scales instead of dividing them. ``add`` is added to the decoded values (GPTQ v1 zero points).
    """

    role: str
    info: TensorInfo
    block: tuple[int, ...]
    codec: str
    view: tuple[int, ...] | None = None
    perm: tuple[int, ...] | None = None
    bits: int = 0
    pack_axis: int | None = None
    field: int = 1
    multiplies: bool = False
    order: tuple[int, ...] | None = None
    add: int = 0


class NotKeepable(Exception):
    """A quantized tensor (or leaf) that cannot be placed packed; the message says why."""


def _normalized(block: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Blocks no larger than their axis (a per-tensor block is the whole shape)."""
    return tuple(max(1, min(b, d)) for b, d in zip(block, shape, strict=True))


def _packed(role: str, info: TensorInfo, block: tuple[int, ...], shape: tuple[int, ...], bits: int, codec: str,
            axis: int, order: tuple[int, ...] | None = None, add: int = 0) -> StoredPart:
    """A part whose elements each pack ``word bits / bits`` fields along ``axis`` (``block`` per field)."""
    if (info.dtype.itemsize * 8) % bits:
        raise NotKeepable(f"{info.name!r}: {bits}-bit fields straddle {info.dtype} words")
    packed = list(block)
    packed[axis] *= info.dtype.itemsize * 8 // bits
    return StoredPart(role, info, _normalized(tuple(packed), shape), codec, bits=bits, pack_axis=axis,
                      field=block[axis], order=order, add=add)


def stored_parts(q: QuantizedTensor) -> dict[str, StoredPart]:
    """The parts of ``q`` by role (``codes``, ``scale``, ``zero_point``, ``global_scale``)."""
    shape, n = q.shape, len(q.shape)
    codes = q.codes
    parts: dict[str, StoredPart] = {}
    if isinstance(codes, PlainCodes):
        parts["codes"] = StoredPart("codes", codes.codes, (1,) * n, "cast")
    elif isinstance(codes, PackedIntCodes):
        parts["codes"] = _packed("codes", codes.codes, (1,) * n, shape, codes.num_bits, "int", n + codes.axis,
                                 codes.order)
    elif isinstance(codes, PackedFp4Codes):
        parts["codes"] = _packed("codes", codes.codes, (1,) * n, shape, FP4_BITS, "e2m1", n - 1)
    elif isinstance(codes, Mxfp4Codes):
        *lead, out, groups, _ = codes.blocks.shape
        swap = _swap(n)
        mx_block = [1] * n
        mx_block[n - 2] = 2
        parts["codes"] = StoredPart("codes", codes.blocks, tuple(mx_block), "e2m1",
                                    view=(*lead, out, groups * MX_BLOCK_BYTES), perm=swap, bits=FP4_BITS,
                                    pack_axis=n - 2)
        mx_block[n - 2] = MX_BLOCK
        parts["scale"] = StoredPart("scale", codes.scales, tuple(mx_block), "e8m0", perm=swap)
    else:  # pragma: no cover - every codec of tensor.py is listed above
        raise NotKeepable(f"{q.name!r}: codes {type(codes).__name__} cannot be kept")
    scales = q.scales
    if isinstance(scales, IndexedScales):
        raise NotKeepable(f"{q.name!r}: its input columns take their groups from g_idx (desc_act), not in blocks")
    if scales is not None:
        parts.update(_scale_parts(scales, shape))
    if q.transposed:
        parts = {role: dataclasses.replace(p, perm=_swap(len(p.info.shape))) if len(p.info.shape) >= 2 else p
                 for role, p in parts.items()}
    for part in parts.values():
        dtype = part.info.dtype
        if part.codec == "cast" and not (dtype.kind in "fiu" or dtype.name in ML_DTYPES or "float8" in dtype.name):
            raise NotKeepable(f"{part.info.name!r}: dtype {part.info.dtype} has no JAX equivalent")
    return parts


def _swap(n: int) -> tuple[int, ...]:
    """The permutation that swaps the last two of ``n`` axes."""
    return (*range(n - 2), n - 1, n - 2)


def _scale_parts(scales: BlockScales, shape: tuple[int, ...]) -> dict[str, StoredPart]:
    """The scale, zero point and global scale parts of block-scaled codes."""
    n = len(shape)
    parts: dict[str, StoredPart] = {}
    block = _normalized(scales.block, shape)
    parts["scale"] = StoredPart("scale", scales.scale, block, "cast")
    if scales.zero_point is not None:
        zero = scales.zero_point
        if scales.zero_point_bits:
            parts["zero_point"] = _packed("zero_point", zero, block, shape, scales.zero_point_bits, "int", n - 2,
                                          scales.zero_point_order, scales.zero_point_add)
        else:
            parts["zero_point"] = StoredPart("zero_point", zero, block, "cast", add=scales.zero_point_add)
    if scales.global_scale is not None:
        parts["global_scale"] = StoredPart("global_scale", scales.global_scale, shape, "cast", view=(1,) * n,
                                           multiplies=scales.global_multiplies)
    return parts
