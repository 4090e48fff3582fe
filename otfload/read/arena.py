"""Reusable scratch memory for the pieces of one shard.

Pieces are read into scratch, carried through hooks (mostly views) and copied once into the shard's
final buffer. Scratch is reused from shard to shard: writing into pages already touched is 3-4×
faster than into fresh ones, and host memory stays bounded by the largest shard's source bytes.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

# numpy views of the scratch as float types are fastest (and SIMD friendly) when aligned.
ALIGNMENT = 64
# (Transparent huge pages via madvise were tried for these buffers and measured 4x *slower* on this VM
# during loads — direct compaction while the page cache is full — so plain allocations are used.)


def aligned_empty(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """A fresh uninitialised array whose data starts on a 64-byte boundary.

    JAX's CPU backend adopts such buffers without copying (``device_put`` aliases them), so a
    shard built here becomes the device buffer as is.
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Arena:
    """A bump allocator over one growing scratch buffer; :meth:`reset` frees everything at once."""

    def __init__(self) -> None:
        self._buffer = np.empty(0, np.uint8)
        self._used = 0

    @property
    def capacity(self) -> int:
        return len(self._buffer)

    def take(self, nbytes: int) -> np.ndarray:
        """``nbytes`` of scratch (uint8), valid until the next :meth:`reset`."""
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if start + nbytes > len(self._buffer):
            # Pieces already handed out keep the old buffer alive until reset; the new one is sized
            # so that a shard of this size fits next time without growing again.
            self._buffer = aligned_empty((max(nbytes + start, 2 * len(self._buffer)),), np.uint8)
            start = 0
        self._used = start + nbytes
        return self._buffer[start : start + nbytes]

    def reset(self) -> None:
        self._used = 0

    def trim(self, max_bytes: int | None) -> None:
        """Free the scratch if it grew beyond ``max_bytes`` (an oversized tensor); call after reset."""
        if max_bytes is not None and self._used == 0 and len(self._buffer) > max_bytes:
            self._buffer = np.empty(0, np.uint8)
