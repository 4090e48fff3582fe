"""How the scales (and zero points, global scale) of a quantized tensor are stored: applied to a
decoded box on the host, and described as stored parts for ``quantized="keep"``.

- :class:`BlockScales`: one scale (and zero point) per block of the tensor, any block shape;
- :class:`IndexedScales`: GPTQ with ``desc_act``, each input column's group read from ``g_idx``
  (not a block layout: such a tensor cannot be kept packed).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otfload.errors import QuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.blocks import Box, apply_blocks, block_box
from otfload.index.quant.codecs import CODECS, cast, packed_int
from otfload.index.quant.codecs.cast import cast_values
from otfload.index.quant.codecs.packed_int import packed_words, unpack_rows
from otfload.index.quant.parts import NotKeepable, Parts, StoredPart, normalized, packed_part

Shape = tuple[int, ...]


@dataclass(frozen=True)
class BlockScales:
    """One scale (and optionally one zero point) per block of ``block`` elements.

    ``zero_point_bits`` > 0: zero points are packed along the rows (axis -2) like compressed-tensors
    writes them. ``global_scale`` (a one-element tensor) divides every scale (compressed-tensors
    NVFP4), or multiplies it when ``global_multiplies`` (ModelOpt NVFP4's ``weight_scale_2``).
    ``scale_codec`` decodes the scales: ``cast`` (float scales), or ``e8m0`` (UE8M0 bytes, stored
    ``float8_e8m0fnu`` and read as uint8: DeepSeek-V4's ``.scale`` tensors).
    """

    scale: TensorInfo
    block: tuple[int, ...]
    zero_point: TensorInfo | None = None
    zero_point_bits: int = 0
    global_scale: TensorInfo | None = None
    global_multiplies: bool = False
    zero_point_order: tuple[int, ...] | None = None  # AWQ's interleave of packed zero points
    zero_point_add: int = 0  # added to each zero point: GPTQ's v1 format stores them minus one
    scale_codec: str = cast.CODEC.name

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
            if self.zero_point_bits:
                rows = block_box(box, self.block)[-2]
                zero = unpack_rows(arrays["zero_point"], self.zero_point_bits, *rows, self.zero_point_order)
            else:
                zero = cast_values(arrays["zero_point"])
            if self.zero_point_add:
                zero += self.zero_point_add
            apply_blocks(values, zero, box, self.block, np.subtract)
        scale = CODECS[self.scale_codec].numpy(arrays["scale"], 0, 0)
        if self.global_scale is not None:
            value = cast_values(arrays["global_scale"]).reshape(())
            scale = scale * value if self.global_multiplies else scale / value
        return apply_blocks(values, scale, box, self.block, np.multiply)

    def stored_parts(self, name: str, shape: Shape) -> dict[str, StoredPart]:
        """The scale, zero point and global scale parts."""
        n = len(shape)
        parts: dict[str, StoredPart] = {}
        block = normalized(self.block, shape)
        parts["scale"] = StoredPart("scale", self.scale, block, self.scale_codec)
        if self.zero_point is not None:
            zero = self.zero_point
            if self.zero_point_bits:
                parts["zero_point"] = packed_part("zero_point", zero, block, shape, self.zero_point_bits,
                                                  packed_int.CODEC.name, n - 2, self.zero_point_order,
                                                  self.zero_point_add)
            else:
                parts["zero_point"] = StoredPart("zero_point", zero, block, cast.CODEC.name, add=self.zero_point_add)
        if self.global_scale is not None:
            parts["global_scale"] = StoredPart("global_scale", self.global_scale, shape, cast.CODEC.name,
                                               view=(1,) * n, multiplies=self.global_multiplies)
        return parts


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
        values *= cast_values(arrays["scale"])[..., group]
        return values

    def stored_parts(self, name: str, shape: Shape) -> dict[str, StoredPart]:
        raise NotKeepable(f"{name!r}: its input columns take their groups from g_idx (desc_act), not in blocks")


Scales = BlockScales | IndexedScales
