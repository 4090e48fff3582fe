"""Read the box of a tensor a shard needs: only its byte runs.

A source that maps files (local directories) gives the box as a zero-copy view of the mapped
tensor; the builder then copies each byte once, from the page cache into its final buffer, and
:meth:`TensorReader.release` drops the mapped pages again. Other sources read the box's byte runs
(see :func:`~otfload.plan.boxes.byte_runs`) into scratch memory. Many short runs with short gaps (a
column block of a matrix) are read as one span and viewed with the tensor's strides: one request
instead of thousands, at the price of reading the gaps.

A quantized tensor (:class:`~otfload.index.quant.QuantizedTensor`) is read as the boxes of its
stored parts that cover the box (codes, scales, zero points), decoded into one float32 array of
the box's shape: no part is read beyond what the box needs, and nothing larger than the box exists.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

from otfload.index.header import TensorInfo
from otfload.index.quant import QuantizedTensor
from otfload.plan.boxes import Box, box_nbytes, box_shape, box_to_slices, byte_runs
from otfload.read.arena import Arena
from otfload.sources.base import RangeRead, Source

# Reading a gap costs gap / ~10 GB/s; a separate request costs ~2 µs locally (a preadv) and far
# more remotely, so gaps up to this size per run are cheaper to read than to skip.
COALESCE_GAP_BYTES = 32 * 1024
# ... but never more than this fraction of the box's own bytes: when a process needs a column block,
# the gaps are the other processes' columns, which it must not read (bytes per process ≈ its share).
MAX_OVERREAD_FRACTION = 0.1


@dataclass
class ReadStats:
    """Counters shared by every reader thread of one load."""

    bytes_read: int = 0
    bytes_needed: int = 0  # the boxes' own bytes; bytes_read adds the gaps read to save requests
    requests: int = 0
    pieces: int = 0
    files: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, file: str, nbytes: int, needed: int, requests: int) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.bytes_needed += needed
            self.requests += requests
            self.pieces += 1
            self.files.add(file)


def stored_box_bytes(info: TensorInfo | QuantizedTensor, box: Box) -> int:
    """Stored bytes a read of ``box`` of ``info`` needs (for a quantized tensor: every part's box)."""
    if isinstance(info, QuantizedTensor):
        return sum(stored_box_bytes(part, pbox) for part, pbox in info.part_boxes(box).values())
    return box_nbytes(box, info.dtype.itemsize)


def element_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape)))


class TensorReader:
    """Reads boxes of tensors from a :class:`~otfload.sources.Source`."""

    def __init__(self, source: Source, stats: ReadStats | None = None):
        self.source = source
        self.stats = stats or ReadStats()

    def read_box(self, info: TensorInfo | QuantizedTensor, box: Box, arena: Arena) -> np.ndarray:
        """The elements of ``info`` inside ``box``, as an array of the box's shape (in scratch)."""
        if isinstance(info, QuantizedTensor):
            parts = info.part_boxes(box)
            return info.decode({role: self.read_box(part, pbox, arena) for role, (part, pbox) in parts.items()}, box)
        runs = byte_runs(info.shape, info.dtype.itemsize, box)
        needed = sum(r.length for r in runs)
        mapped = self._mapped(info)
        if mapped is not None:
            if runs:
                start, end = runs[0].offset, runs[-1].offset + runs[-1].length
                self.source.prefetch(info.file, info.offset + start, end - start)
            self.stats.add(info.file, needed, needed, 1 if runs else 0)
            whole = np.frombuffer(mapped, info.dtype, math.prod(info.shape), info.offset).reshape(info.shape)
            return whole[box_to_slices(box)]
        span = runs[-1].offset + runs[-1].length - runs[0].offset if runs else 0
        if len(runs) > 1 and span - needed <= min(COALESCE_GAP_BYTES * (len(runs) - 1), MAX_OVERREAD_FRACTION * needed):
            buffer = arena.take(span)
            self.source.read_into(info.file, info.offset + runs[0].offset, memoryview(buffer))
            self.stats.add(info.file, span, needed, 1)
            return np.lib.stride_tricks.as_strided(
                buffer.view(info.dtype),
                shape=box_shape(box),
                strides=element_strides(info.shape, info.dtype.itemsize),
                writeable=False,
            )
        buffer = arena.take(needed)
        reads, pos = [], 0
        for run in runs:
            reads.append(RangeRead(info.file, info.offset + run.offset, memoryview(buffer[pos : pos + run.length])))
            pos += run.length
        self.source.read_many(reads)
        self.stats.add(info.file, needed, needed, len(reads))
        return buffer.view(info.dtype).reshape(box_shape(box))

    def _mapped(self, info: TensorInfo):
        # The source checks that the file still holds the whole tensor before anything touches it.
        mapped = getattr(self.source, "mapped", None)
        return mapped(info.file, info.offset, info.nbytes) if mapped is not None else None

    def release(self, info: TensorInfo | QuantizedTensor, box: Box) -> None:
        """Done with ``box`` of ``info``: let a mapping source drop its pages from our memory."""
        if isinstance(info, QuantizedTensor):
            for part, pbox in info.part_boxes(box).values():
                self.release(part, pbox)
            return
        release = getattr(self.source, "release", None)
        runs = byte_runs(info.shape, info.dtype.itemsize, box)
        if release is not None and runs:
            start, end = runs[0].offset, runs[-1].offset + runs[-1].length
            release(info.file, info.offset + start, end - start)
