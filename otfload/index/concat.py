"""Concatenated tensors: one index entry made of ranges of stored tensors laid end to end on an axis.

MaxText's Qwen3.5 kernels are HF tensors joined: ``in_proj_qkvz`` is, key head by key head, that
head's rows of ``in_proj_qkv``'s q, k and v blocks then of ``in_proj_z``. A
:class:`ConcatenatedTensor` stands in the index under such a name, so a rule, its hooks, stacking and
sharding treat it as one tensor, while a read of a box reads only the box of each stored range it
overlaps (:meth:`ConcatenatedTensor.part_boxes`) and joins them (:meth:`ConcatenatedTensor.decode`).
A range of a derived tensor (a quantized one: FP8 codes and block scales) reads its parts' boxes for its
rows and is decoded as it is read, before the join. A rule says how with
:class:`~otfload.plan.mapping.Join`; export writes each stored tensor back from its rows (:func:`head_runs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from otfload.errors import MappingError
from otfload.index.derived import Box, DerivedTensor, Parts, is_derived
from otfload.index.header import TensorInfo


@dataclass(frozen=True)
class Piece:
    """Rows ``start .. stop`` (on the concatenation axis) of the stored (or derived) tensor ``info``."""

    info: TensorInfo | DerivedTensor
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class ConcatenatedTensor:
    """``pieces`` joined on ``axis``, named ``name`` (a :class:`~otfload.index.derived.DerivedTensor`)."""

    name: str
    pieces: tuple[Piece, ...]
    axis: int = 0

    def __post_init__(self) -> None:
        if not self.pieces:
            raise MappingError(f"{self.name}: no tensors to concatenate")
        first = self.pieces[0].info
        for piece in self.pieces:
            info = piece.info
            other = [d for d, (n, m) in enumerate(zip(info.shape, first.shape, strict=False))
                     if d != self.axis and n != m]
            if (info.dtype != first.dtype or len(info.shape) != len(first.shape) or other
                    or not 0 <= piece.start < piece.stop <= info.shape[self.axis]):
                raise MappingError(f"{self.name}: {info.name} {info.dtype}{list(info.shape)} rows "
                                   f"{piece.start}..{piece.stop} do not join {first.name} {first.dtype}"
                                   f"{list(first.shape)} on axis {self.axis}")

    @property
    def shape(self) -> tuple[int, ...]:
        shape = list(self.pieces[0].info.shape)
        shape[self.axis] = sum(p.length for p in self.pieces)
        return tuple(shape)

    @property
    def dtype(self) -> np.dtype:
        return self.pieces[0].info.dtype

    @property
    def storage(self) -> str:
        first = self.pieces[0].info
        return f"{first.storage if is_derived(first) else first.dtype} (concatenated)"

    @property
    def file(self) -> str:
        return self.pieces[0].info.file

    @property
    def nbytes(self) -> int:
        return sum(p.info.nbytes * p.length // p.info.shape[self.axis] for p in self.pieces)

    def _spans(self, lo: int, hi: int) -> list[tuple[int, Piece, int, int]]:
        """``(index, piece, from, to)``: the stored rows of each piece that rows ``lo .. hi`` cover."""
        out, at = [], 0
        for i, piece in enumerate(self.pieces):
            a, b = max(lo, at), min(hi, at + piece.length)
            if a < b:
                out.append((i, piece, piece.start + a - at, piece.start + b - at))
            at += piece.length
        return out

    def _piece_boxes(self, box: Box) -> list[tuple[int, TensorInfo | DerivedTensor, Box]]:
        """``(index, piece's tensor, its box)`` of each piece ``box`` overlaps, in joined order."""
        d = self.axis
        return [(i, piece.info, (*box[:d], (a, b), *box[d + 1 :])) for i, piece, a, b in self._spans(*box[d])]

    def part_boxes(self, box: Box) -> Parts:
        """For each piece ``box`` overlaps, the box of its stored tensor (role: the piece's position), or
        of each part of its derived tensor (roles ``<position>.<part role>``)."""
        parts: Parts = {}
        for i, info, pbox in self._piece_boxes(box):
            if is_derived(info):
                parts.update({f"{i}.{role}": part for role, part in info.part_boxes(pbox).items()})
            else:
                parts[str(i)] = (info, pbox)
        return parts

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        """``box`` of the joined tensor from its pieces' boxes (a derived piece decoded from its parts')."""
        values = []
        for i, info, pbox in self._piece_boxes(box):
            if is_derived(info):
                prefix = f"{i}."
                values.append(info.decode({r[len(prefix):]: a for r, a in arrays.items() if r.startswith(prefix)},
                                          pbox))
            else:
                values.append(arrays[str(i)])
        return values[0] if len(values) == 1 else np.concatenate(values, axis=self.axis)


def head_runs(sizes: Sequence[Sequence[int]], heads: int, name: str) -> list[tuple[int, int, int]]:
    """``(source, start, stop)`` rows in joined order: each source (by position) holding blocks of
    ``sizes`` rows one after the other, each block ``heads`` equal runs; for each head ``h``, run ``h``
    of every block of every source in order (MaxText's ``in_proj_qkvz``)."""
    blocks: list[tuple[int, int, int]] = []
    for s, source_sizes in enumerate(sizes):
        at = 0
        for size in source_sizes:
            if heads < 1 or size % heads:
                raise MappingError(f"{name}: a block of {size} rows of part {s} does not split into {heads} heads")
            blocks.append((s, at, size // heads))
            at += size
    return [(s, start + h * run, start + (h + 1) * run) for h in range(heads) for s, start, run in blocks]


def head_blocks(
    name: str, sources: Sequence[tuple[TensorInfo | DerivedTensor, Sequence[int]]], heads: int
) -> ConcatenatedTensor:
    """The tensor :func:`head_runs` joins from ``sources`` (each ``(info, block sizes)``), named ``name``."""
    runs = head_runs([sizes for _, sizes in sources], heads, name)
    return ConcatenatedTensor(name, tuple(Piece(sources[s][0], a, b) for s, a, b in runs))
