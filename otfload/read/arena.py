"""Reusable scratch memory for the pieces of one shard.

Pieces are read into scratch, carried through hooks (mostly views) and copied once into the shard's
final buffer. Scratch is reused from shard to shard: writing into pages already touched is 3-4×
faster than into fresh ones, and host memory stays bounded by the largest shard's source bytes.

An arena given a :class:`~otfload.read.pinned.DmaRegistry` registers each buffer it makes for direct
DMA (an accelerator's staging): a buffer it outgrows may still be read by a transfer in flight, so
it is unregistered and dropped only at :meth:`Arena.reset`, which the builder calls once the device
holds the leaf.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from otfload.pages import populate_write
from otfload.read.pinned import DmaRegistry

# numpy views of the scratch as float types are fastest (and SIMD friendly) when aligned.
ALIGNMENT = 64
# Buffers of at least this size get a private anonymous mapping of their own, populated up front, not
# ``np.empty``: numpy asks for transparent huge pages (``madvise(MADV_HUGEPAGE)``) on every array of
# 4 MiB or more, and on this VM (THP "madvise", defrag "madvise") a huge page is found by direct
# compaction and reclaim among the page cache the load reads, then zeroed from memory the host has to
# fault in: ``clear_page`` was 66 % of a 1 GiB load's CPU samples (perf). Plain 4 KiB pages populated
# in one call — page tables built at once, no fault per page while copying — took the 1 GiB Llama
# load from 2.26 to 1.21 CPU-seconds (medians of 4; without populating 1.39). The populate runs
# without the GIL (:mod:`otfload.pages`; ``MAP_POPULATE`` through Python's ``mmap`` holds it). Below
# 256 KiB (64 pages) the extra mmap/munmap costs more than the faults it saves; numpy's heap is used.
OWN_MAPPING_BYTES = 256 << 10
_MAP_FLAGS = (
    mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")
    else None  # Windows: numpy's allocation
)


def aligned_empty(shape: tuple[int, ...], dtype: npt.DTypeLike, populate: bool = True) -> np.ndarray:
    """A fresh uninitialised array whose data starts on a 64-byte boundary.

    JAX's CPU backend adopts such buffers without copying (``device_put`` aliases them), so a
    shard built here becomes the device buffer as is. Large ones are mapped and populated up front
    (see :data:`OWN_MAPPING_BYTES`), unless ``populate`` is False: the caller populates each part
    just before writing it (:func:`~otfload.pages.populate_pages`).
    """
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes >= OWN_MAPPING_BYTES and _MAP_FLAGS is not None:
        region = mmap.mmap(-1, nbytes, flags=_MAP_FLAGS)  # page-aligned; freed when the last view goes
        if populate:
            populate_write(region)
        return np.frombuffer(region, np.uint8, nbytes).view(dtype).reshape(shape)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


class Arena:
    """A bump allocator over one growing scratch buffer; :meth:`reset` frees everything at once.

    With ``registry``, every buffer it makes is registered for direct DMA, and :meth:`close`
    unregisters them (call it once nothing reads them any more)."""

    def __init__(self, registry: DmaRegistry | None = None) -> None:
        self._buffer = np.empty(0, np.uint8)
        self._used = 0
        self._registry = registry
        self._registered = False  # whether self._buffer is registered
        self._outgrown: list[np.ndarray] = []  # registered buffers replaced since the last reset
        self._kept: list[Callable[[], None]] = []  # called at the next reset (see keep)

    @property
    def capacity(self) -> int:
        return len(self._buffer)

    @property
    def registered(self) -> bool:
        """Whether the current buffer is registered for direct DMA."""
        return self._registered

    def _replace(self, nbytes: int) -> None:
        if self._registered:
            self._outgrown.append(self._buffer)  # a transfer may still read it: kept until reset
        self._buffer = aligned_empty((nbytes,), np.uint8) if nbytes else np.empty(0, np.uint8)
        self._registered = self._registry is not None and self._registry.register(self._buffer)

    def take(self, nbytes: int, align: int = ALIGNMENT) -> np.ndarray:
        """``nbytes`` of scratch (uint8) whose address is a multiple of ``align``, valid until the
        next :meth:`reset`."""
        start = self._used + (-(self._buffer.ctypes.data + self._used) % align)
        if start + nbytes > len(self._buffer):
            # Pieces already handed out keep the old buffer alive until reset; the new one is sized
            # so that a shard of this size fits next time without growing again.
            self._replace(max(nbytes + start + align, 2 * len(self._buffer)))
            start = -self._buffer.ctypes.data % align
        self._used = start + nbytes
        return self._buffer[start : start + nbytes]

    def reserve(self, nbytes: int, takes: int = 1) -> None:
        """Room for ``takes`` pieces of ``nbytes`` in all before the next :meth:`reset`, in one buffer:
        grown once to the size, not by doubling through the takes (each step a fresh mapping whose
        pages are faulted in anew). Call after reset."""
        needed = nbytes + takes * ALIGNMENT
        if self._used == 0 and needed > len(self._buffer):
            self._replace(needed)

    def keep(self, release: Callable[[], None]) -> None:
        """Call ``release`` at the next :meth:`reset`: scratch from elsewhere (a run read ahead) that
        is valid until then, like the arena's own."""
        self._kept.append(release)

    def reset(self) -> None:
        self._used = 0
        self._release(self._outgrown)
        self._outgrown = []
        kept, self._kept = self._kept, []
        for release in kept:
            release()

    def trim(self, max_bytes: int | None) -> None:
        """Free the scratch if it grew beyond ``max_bytes`` (an oversized tensor); call after reset."""
        if max_bytes is not None and self._used == 0 and len(self._buffer) > max_bytes:
            self._release([self._buffer] if self._registered else [])
            self._buffer, self._registered = np.empty(0, np.uint8), False

    def close(self) -> None:
        """Unregister and free every buffer; the arena is empty (and usable) afterwards."""
        self.reset()
        self.trim(0)

    def _release(self, buffers: list[np.ndarray]) -> None:
        if self._registry is not None:
            for buffer in buffers:
                self._registry.unregister(buffer)
