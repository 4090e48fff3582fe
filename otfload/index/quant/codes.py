"""How the codes of a quantized tensor are stored, by layout: a box of each decoded on the host, and
each described as stored parts for ``quantized="keep"``.

- :class:`PlainCodes`: one code per element in the tensor's own layout (FP8, int8): ``cast``;
- :class:`PackedIntCodes`: ``b``-bit integers packed into int32 words along the columns, or along
  the rows with AWQ's interleave: ``int``;
- :class:`PackedFp4Codes`: FP4 E2M1 two per byte along the last axis (NVFP4): ``e2m1``;
- :class:`Mxfp4Codes`: GPT-OSS MXFP4 blocks of 32 FP4 values (``e2m1``) with one E8M0 scale
  (``e8m0``) each, the matrix stored transposed.

The codecs named are those of :mod:`otfload.index.quant.codecs`, whose numpy decoders read here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otfload.index.header import TensorInfo
from otfload.index.quant.blocks import Box
from otfload.index.quant.codecs import cast, e2m1, e8m0, packed_int
from otfload.index.quant.codecs.cast import cast_values
from otfload.index.quant.codecs.e2m1 import FP4_BITS, fp4_values
from otfload.index.quant.codecs.e8m0 import e8m0_values
from otfload.index.quant.codecs.packed_int import packed_words, unpack_ints, unpack_rows
from otfload.index.quant.parts import Parts, StoredPart, packed_part, swap_last

Shape = tuple[int, ...]
# MXFP4 (OCP microscaling): 32 FP4 values share one E8M0 scale, stored as 16 bytes per block.
MX_BLOCK = 32
MX_BLOCK_BYTES = MX_BLOCK // 2


@dataclass(frozen=True)
class PlainCodes:
    """Codes stored one per element in the tensor's own layout (FP8, int8)."""

    codes: TensorInfo

    def part_boxes(self, box: Box) -> Parts:
        return {"codes": (self.codes, box)}

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        return cast_values(arrays["codes"])

    def stored_parts(self, name: str, shape: Shape) -> dict[str, StoredPart]:
        return {"codes": StoredPart("codes", self.codes, (1,) * len(shape), cast.CODEC.name)}


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

    def stored_parts(self, name: str, shape: Shape) -> dict[str, StoredPart]:
        n = len(shape)
        return {"codes": packed_part("codes", self.codes, (1,) * n, shape, self.num_bits, packed_int.CODEC.name,
                                     n + self.axis, self.order)}


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

    def stored_parts(self, name: str, shape: Shape) -> dict[str, StoredPart]:
        n = len(shape)
        return {"codes": packed_part("codes", self.codes, (1,) * n, shape, FP4_BITS, e2m1.CODEC.name, n - 1)}


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

    def stored_parts(self, name: str, shape: Shape) -> dict[str, StoredPart]:
        """The blocks viewed as ``[..., out, in/2]`` and the scales, both transposed to ``in``-major:
        codes in blocks of 2 along ``in`` (one byte), scales in blocks of 32."""
        n = len(shape)
        *lead, out, groups, _ = self.blocks.shape
        swap = swap_last(n)
        mx_block = [1] * n
        mx_block[n - 2] = 2
        codes = StoredPart("codes", self.blocks, tuple(mx_block), e2m1.CODEC.name,
                           view=(*lead, out, groups * MX_BLOCK_BYTES), perm=swap, bits=FP4_BITS, pack_axis=n - 2)
        mx_block[n - 2] = MX_BLOCK
        return {"codes": codes, "scale": StoredPart("scale", self.scales, tuple(mx_block), e8m0.CODEC.name, perm=swap)}


Codes = PlainCodes | PackedIntCodes | PackedFp4Codes | Mxfp4Codes
