"""The stored parts of a quantized tensor, each described in the coordinates of the float tensor.

Keeping a weight quantized (``quantized="keep"``) places its stored parts (codes, scales, zero
points, global scale) as they are, so each part is described as a *blocked view* of the float
tensor it stands for: after an optional reshape and permutation of the stored bytes (``view``,
``perm``), the part has the float tensor's rank and one element of it covers ``block[d]``
consecutive elements along each axis ``d``. That one description serves every layout:

- plain codes (FP8, int8): block 1 everywhere;
- codes packed ``k`` per word along the last axis (int4 in int32: 8; FP4 in uint8: 2): block ``k``
  on that axis, and the codec (:mod:`otfload.index.quant.codecs`) says how to unpack;
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

Each layout of codes and scales describes its own parts (``stored_parts`` of the classes in
:mod:`~otfload.index.quant.codes` and :mod:`~otfload.index.quant.scales`). The plan carries these
blocks through the mapping hooks (:mod:`otfload.plan.keep`), and :func:`otfload.quantized.dequantize`
expands them back with each part's codec, the device twin of
:meth:`~otfload.index.quant.tensor.QuantizedTensor.decode`.
"""


from __future__ import annotations

from dataclasses import dataclass

from otfload.index.header import TensorInfo
from otfload.index.quant.blocks import Box

# Each stored part's box that covers a box of the float tensor, by role (``codes``, ``scale``, ...).
Parts = dict[str, tuple[TensorInfo, Box]]
# Non-numpy dtypes a part may be stored in (ml_dtypes; JAX arrays hold them as they are).
ML_DTYPES = frozenset({"bfloat16"})


@dataclass(frozen=True)
class StoredPart:
    """One stored tensor of a quantized weight, as a blocked view of the weight (see module doc).

    ``codec`` is a key of :data:`otfload.index.quant.codecs.CODECS`: how the part's values become
    float32. ``pack_axis`` (packed parts only) is the axis along which ``bits``-bit fields are
    packed into each element, lowest bits first; each field covers ``field`` elements of the weight
    along it (1 for codes, the scale block's rows for packed zero points); ``order``: element ``j``
    of each word is its field ``order[j]`` (AWQ). ``multiplies`` (global scales only): the value
    multiplies the scales instead of dividing them. ``add`` is added to the decoded values (GPTQ v1
    zero points).
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

    def check_keepable(self) -> None:
        """:class:`NotKeepable` when the part's stored dtype has no JAX equivalent."""
        dtype = self.info.dtype
        if self.codec == "cast" and not (dtype.kind in "fiu" or dtype.name in ML_DTYPES or "float8" in dtype.name):
            raise NotKeepable(f"{self.info.name!r}: dtype {self.info.dtype} has no JAX equivalent")


class NotKeepable(Exception):
    """A quantized tensor (or leaf) that cannot be placed packed; the message says why."""


def normalized(block: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
    """Blocks no larger than their axis (a per-tensor block is the whole shape)."""
    return tuple(max(1, min(b, d)) for b, d in zip(block, shape, strict=True))


def packed_part(role: str, info: TensorInfo, block: tuple[int, ...], shape: tuple[int, ...], bits: int, codec: str,
                axis: int, order: tuple[int, ...] | None = None, add: int = 0) -> StoredPart:
    """A part whose elements each pack ``word bits / bits`` fields along ``axis`` (``block`` per field)."""
    if (info.dtype.itemsize * 8) % bits:
        raise NotKeepable(f"{info.name!r}: {bits}-bit fields straddle {info.dtype} words")
    packed = list(block)
    packed[axis] *= info.dtype.itemsize * 8 // bits
    return StoredPart(role, info, normalized(tuple(packed), shape), codec, bits=bits, pack_axis=axis,
                      field=block[axis], order=order, add=add)


def swap_last(n: int) -> tuple[int, ...]:
    """The permutation that swaps the last two of ``n`` axes."""
    return (*range(n - 2), n - 1, n - 2)
