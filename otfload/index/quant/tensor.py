"""A quantized tensor seen as the float tensor it stands for.

:class:`QuantizedTensor` replaces its stored parts (codes, scales, zero points, global scale) in
the checkpoint index under the name and shape of the dequantised HF parameter, so mapping rules,
hooks, shape checks and sharding treat it like any tensor. Reading a box of it reads only the part
boxes covering that box (:meth:`QuantizedTensor.part_boxes`) and decodes them into one float32
array of the box's shape (:meth:`QuantizedTensor.decode`): codes are widened, zero points
subtracted and scales multiplied block by block (:func:`~otfload.index.quant.blocks.apply_blocks`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from otfload.errors import QuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.blocks import Box, apply_blocks, block_box
from otfload.index.quant.codes import e8m0_values, fp4_values, packed_words, unpack_ints, unpack_rows

Parts = dict[str, tuple[TensorInfo, Box]]
FLOAT32 = np.dtype(np.float32)
# MXFP4 (OCP microscaling): 32 FP4 values share one E8M0 scale, stored as 16 bytes per block.
MX_BLOCK = 32
MX_BLOCK_BYTES = MX_BLOCK // 2


@functools.cache
def byte_table(dtype: np.dtype) -> np.ndarray:
    """The float32 value of each of the 256 byte codes of a one-byte dtype."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(FLOAT32)


def as_grid(info: TensorInfo, grid: tuple[int, ...]) -> TensorInfo | None:
    """``info`` viewed with shape ``grid`` when that only adds or drops size-1 axes (same bytes)."""
    squeeze = tuple(d for d in info.shape if d != 1)
    if math.prod(info.shape) != math.prod(grid) or squeeze != tuple(d for d in grid if d != 1):
        return None
    return info._replace(shape=grid)


@dataclass(frozen=True)
class PlainCodes:
    """Codes stored one per element in the tensor's own layout (FP8, int8)."""

    codes: TensorInfo

    def part_boxes(self, box: Box) -> Parts:
        return {"codes": (self.codes, box)}

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        codes = arrays["codes"]
        if codes.dtype.itemsize == 1:  # FP8 / int8: a 256-entry table is 3x faster than astype (measured)
            return byte_table(codes.dtype)[codes.view(np.uint8)]
        return codes.astype(FLOAT32)


@dataclass(frozen=True)
class PackedIntCodes:
    """``num_bits`` integers packed densely along ``axis`` (-1, or -2: AWQ's output rows) into int32
    words; ``order``: element ``j`` of each word is its field ``order[j]`` (AWQ's interleave)."""

    codes: TensorInfo
    num_bits: int
    axis: int = -1
    order: tuple[int, ...] | None = None

    def part_boxes(self, box: Box) -> Parts:
        words = list(box)
        words[self.axis] = packed_words(*box[self.axis], self.num_bits)
        return {"codes": (self.codes, tuple(words))}

    def __post_init__(self) -> None:
        if self.axis not in (-1, -2) or (self.order is not None and self.axis != -2):
            raise ValueError(f"codes packed along axis {self.axis} with order {self.order}: not a layout")

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        if self.axis == -2:
            return unpack_rows(arrays["codes"], self.num_bits, *box[-2], self.order)
        return unpack_ints(arrays["codes"], self.num_bits, *box[-1])


@dataclass(frozen=True)
class PackedFp4Codes:
    """FP4 E2M1 codes, two per byte along the last axis, low nibble first (NVFP4)."""

    codes: TensorInfo

    def part_boxes(self, box: Box) -> Parts:
        (start, stop) = box[-1]
        return {"codes": (self.codes, (*box[:-1], (start // 2, -(-stop // 2))))}

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        (start, stop) = box[-1]
        skip = start % 2
        return fp4_values(arrays["codes"])[..., skip : skip + stop - start]


@dataclass(frozen=True)
class BlockScales:
    """One scale (and optionally one zero point) per block of ``block`` elements.

    ``zero_point_bits`` > 0: zero points are packed along the rows (axis -2) like compressed-tensors
    writes them. ``global_scale`` (a one-element tensor) divides every scale (compressed-tensors
    NVFP4), or multiplies it when ``global_multiplies`` (ModelOpt NVFP4's ``weight_scale_2``).
    """

    scale: TensorInfo
    block: tuple[int, ...]
    zero_point: TensorInfo | None = None
    zero_point_bits: int = 0
    global_scale: TensorInfo | None = None
    global_multiplies: bool = False
    zero_point_order: tuple[int, ...] | None = None  # AWQ's interleave of packed zero points
    zero_point_add: int = 0  # added to each zero point: GPTQ's v1 format stores them minus one

    def part_boxes(self, box: Box) -> Parts:
        grid = block_box(box, self.block)
        parts = {"scale": (self.scale, grid)}
        if self.zero_point is not None:
            zbox = grid
            if self.zero_point_bits:
                zbox = (*grid[:-2], packed_words(*grid[-2], self.zero_point_bits), grid[-1])
            parts["zero_point"] = (self.zero_point, zbox)
        if self.global_scale is not None:
            parts["global_scale"] = (self.global_scale, tuple((0, d) for d in self.global_scale.shape))
        return parts

    def apply(self, values: np.ndarray, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        if self.zero_point is not None:
            zero = arrays["zero_point"].astype(FLOAT32)
            if self.zero_point_bits:
                rows = block_box(box, self.block)[-2]
                zero = unpack_rows(arrays["zero_point"], self.zero_point_bits, *rows, self.zero_point_order)
            if self.zero_point_add:
                zero += self.zero_point_add
            apply_blocks(values, zero, box, self.block, np.subtract)
        scale = arrays["scale"].astype(FLOAT32)
        if self.global_scale is not None:
            value = arrays["global_scale"].astype(FLOAT32).reshape(())
            scale = scale * value if self.global_multiplies else scale / value
        return apply_blocks(values, scale, box, self.block, np.multiply)


@dataclass(frozen=True)
class IndexedScales:
    """GPTQ with ``desc_act``: input column ``i`` (the last axis) uses group ``g_idx[i]``, any order.

    ``scale`` ``[..., out, groups]`` and ``zero_point`` (``zero_point_bits``-bit, packed along the
    rows) are read whole along the groups for the box's rows; ``g_idx`` for the box's columns picks
    each column's group. A group index outside ``[0, groups)`` is a :class:`QuantizationError`.
    """

    scale: TensorInfo
    groups: int
    g_idx: TensorInfo
    zero_point: TensorInfo
    zero_point_bits: int
    zero_point_add: int = 0

    def part_boxes(self, box: Box) -> Parts:
        *lead, rows, columns = box
        return {"scale": (self.scale, (*lead, rows, (0, self.groups))),
                "zero_point": (self.zero_point, (*lead, packed_words(*rows, self.zero_point_bits), (0, self.groups))),
                "g_idx": (self.g_idx, (columns,))}

    def apply(self, values: np.ndarray, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        group = arrays["g_idx"].astype(np.int64)
        bad = np.flatnonzero((group < 0) | (group >= self.groups))
        if bad.size:
            raise QuantizationError(f"{self.g_idx.name!r}[{box[-1][0] + int(bad[0])}] = {int(group[bad[0]])}: "
                                    f"a group outside [0, {self.groups})")
        zero = unpack_rows(arrays["zero_point"], self.zero_point_bits, *box[-2]) + self.zero_point_add
        values -= zero[..., group]
        values *= arrays["scale"].astype(FLOAT32)[..., group]
        return values


@dataclass(frozen=True)
class Mxfp4Codes:
    """GPT-OSS MXFP4: ``blocks`` U8 ``[..., out, in/32, 16]`` and ``scales`` U8 ``[..., out, in/32]``
    (E8M0), standing for the float tensor ``[..., in, out]`` (the stored matrix is transposed)."""

    blocks: TensorInfo
    scales: TensorInfo

    def part_boxes(self, box: Box) -> Parts:
        *lead, (i0, i1), out = box
        groups = (i0 // MX_BLOCK, -(-i1 // MX_BLOCK))
        return {
            "blocks": (self.blocks, (*lead, out, groups, (0, MX_BLOCK_BYTES))),
            "scales": (self.scales, (*lead, out, groups)),
        }

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        (i0, i1) = box[-2]
        values = fp4_values(arrays["blocks"])  # [..., out, g, 32]
        values *= e8m0_values(arrays["scales"])[..., None]
        values = values.reshape(*values.shape[:-2], -1)
        skip = i0 - (i0 // MX_BLOCK) * MX_BLOCK
        return np.swapaxes(values[..., skip : skip + i1 - i0], -1, -2)


Codes = PlainCodes | PackedIntCodes | PackedFp4Codes | Mxfp4Codes
Scales = BlockScales | IndexedScales


@dataclass(frozen=True)
class QuantizedTensor:
    """A stored quantized tensor standing for the float32 tensor ``name`` of ``shape``.

    Quacks like :class:`~otfload.index.header.TensorInfo` where the plan needs it (``name``,
    ``dtype``, ``shape``, ``file``, ``nbytes``: the stored bytes of every part).

    ``transposed``: every stored part of two or more axes holds its last two axes swapped (GPTQ and
    AWQ store ``[in, out]``-major); codes and scales describe the parts in the tensor's own
    orientation, and the boxes read and the arrays decoded are swapped here.
    """

    name: str
    shape: tuple[int, ...]
    codes: Codes
    scales: Scales | None
    storage: str  # what ``otfload inspect`` shows, e.g. "fp8 e4m3, f32 scales per 128x128 block"
    transposed: bool = False

    dtype = FLOAT32

    @property
    def parts(self) -> tuple[TensorInfo, ...]:
        box = tuple((0, d) for d in self.shape)
        return tuple(info for info, _ in self.part_boxes(box).values())

    @property
    def file(self) -> str:
        return self.parts[0].file

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def part_boxes(self, box: Box) -> Parts:
        """For each stored part, the box of it that covers ``box`` of the float tensor."""
        parts = self.codes.part_boxes(box)
        if self.scales is not None:
            parts.update(self.scales.part_boxes(box))
        if self.transposed:
            parts = {role: (info, _swap(b)) for role, (info, b) in parts.items()}
        return parts

    def oriented(self, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The part boxes read for a box (by role) in the tensor's orientation: views, swapped back
        where the parts are stored transposed."""
        if not self.transposed:
            return arrays
        return {role: np.swapaxes(a, -1, -2) if a.ndim >= 2 else a for role, a in arrays.items()}

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        """The float32 values of ``box`` from the part boxes read for it (``arrays`` by role)."""
        arrays = self.oriented(arrays)
        values = self.codes.decode(arrays, box)
        if self.scales is not None:
            values = self.scales.apply(values, arrays, box)
        return values


def _swap(box: Box) -> Box:
    """``box`` with its last two axes swapped (a box of one axis is unchanged)."""
    return (*box[:-2], box[-1], box[-2]) if len(box) >= 2 else box
