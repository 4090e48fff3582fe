"""A quantized tensor seen as the float tensor it stands for.

:class:`QuantizedTensor` replaces its stored parts (codes, scales, zero points, global scale) in
the checkpoint index under the name and shape of the dequantised HF parameter, so mapping rules,
hooks, shape checks and sharding treat it like any tensor. Reading a box of it reads only the part
boxes covering that box (:meth:`QuantizedTensor.part_boxes`) and decodes them into one float32
array of the box's shape (:meth:`QuantizedTensor.decode`): codes are widened
(:mod:`~otfload.index.quant.codes`), zero points subtracted and scales multiplied block by block
(:mod:`~otfload.index.quant.scales`, :func:`~otfload.index.quant.blocks.apply_blocks`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np

from otfload.index.header import TensorInfo
from otfload.index.quant.blocks import Box
from otfload.index.quant.codecs.cast import FLOAT32
from otfload.index.quant.codes import Codes
from otfload.index.quant.parts import Parts, StoredPart, swap_last
from otfload.index.quant.scales import Scales


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

    @functools.cached_property
    def parts(self) -> tuple[TensorInfo, ...]:
        box = tuple((0, d) for d in self.shape)
        return tuple(info for info, _ in self.part_boxes(box).values())

    @property
    def file(self) -> str:
        return self.parts[0].file

    @functools.cached_property
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

    def stored_parts(self) -> dict[str, StoredPart]:
        """The parts by role (``codes``, ``scale``, ``zero_point``, ``global_scale``), each a blocked
        view of this tensor (:mod:`~otfload.index.quant.parts`); :class:`~otfload.index.quant.parts.NotKeepable`
        when one cannot be placed packed."""
        parts = self.codes.stored_parts(self.name, self.shape)
        if self.scales is not None:
            parts.update(self.scales.stored_parts(self.name, self.shape))
        if self.transposed:
            parts = {role: dataclasses.replace(p, perm=swap_last(len(p.info.shape))) if len(p.info.shape) >= 2 else p
                     for role, p in parts.items()}
        for part in parts.values():
            part.check_keepable()
        return parts


def _swap(box: Box) -> Box:
    """``box`` with its last two axes swapped (a box of one axis is unchanged)."""
    return (*box[:-2], box[-1], box[-2]) if len(box) >= 2 else box
