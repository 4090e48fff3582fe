"""Read the box of a tensor a shard needs: only its byte runs.

A source that maps files (local directories) gives the box as a zero-copy view of the mapped
tensor; the builder then copies each byte once, from the page cache into its final buffer, and
:meth:`TensorReader.release` drops the mapped pages again. Other sources read the box's byte runs
(see :func:`~otfload.plan.boxes.byte_runs`) into scratch memory. Many short runs with short gaps (a
column block of a matrix) are read as one span and viewed with the tensor's strides: one request
instead of thousands, at the price of reading the gaps.

Files the load found cold (:attr:`TensorReader.direct_files`) are read with ``O_DIRECT`` where their
file system allows it: the same page runs, widened to the disk's block alignment, land in aligned
scratch (no page cache filled or mapped), and the box is a view of them or gathered from them; a
load reads those runs ahead of its builders into a bounded ring (:attr:`TensorReader.ahead`,
:mod:`otfload.read.direct_ahead`), which the builders then take instead of reading.

A derived tensor (:class:`~otfload.index.derived.DerivedTensor`: a quantized weight, a weight with
LoRA adapters merged in) is read as the boxes of its stored parts that cover the box (codes, scales,
zero points; base and low-rank factors), decoded into one float32 array of the box's shape: no part
is read beyond what the box needs, and nothing larger than the box exists.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol, cast

import numpy as np

from otfload.accounting.gaps import (
    BOX_SPAN_GAP_BYTES,
    MAPPED_GAP_BYTES,
    MAX_GAP_FRACTION,
    PAGE_BYTES,
    PLANNED_GAPS,
    merge_run_arrays,
    page_run_arrays,
)
from otfload.accounting.meter import expected_fetch, fetching
from otfload.accounting.requests import remote_fetch
from otfload.errors import TruncatedFileError
from otfload.index.derived import DerivedTensor, is_derived
from otfload.index.header import TensorInfo
from otfload.plan.boxes import (
    Box,
    ByteRun,
    Selection,
    box_nbytes,
    box_selection,
    box_shape,
    box_to_slices,
    byte_runs,
    selection_piece_arrays,
    selection_size,
)
from otfload.plan.leaf_bytes import part_selections, useful_selection
from otfload.read.arena import Arena
from otfload.sources.base import (
    DirectSource,
    MappedSource,
    PageGranularSource,
    RangePrefetchingSource,
    RangeRead,
    Source,
    read_many,
)

# Set to 0 to read cold local files through the page cache like warm ones (no O_DIRECT).
DIRECT_IO_ENV = "OTFLOAD_DIRECT_IO"


class ReadAheadRuns(Protocol):
    """Block-aligned runs of ``O_DIRECT`` files read ahead of the builders
    (:class:`~otfload.read.direct_ahead.DirectAhead`)."""

    def claim(self, file: str, start: int, end: int) -> tuple[np.ndarray, int | None, Callable[[], None]] | None:
        """``(room, bytes the file held, give back)`` of run ``[start, end)`` of ``file``: read
        already, or (None) room to read it into; None: the caller reads it elsewhere."""
        ...


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


def element_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    return tuple(math.prod(shape[d + 1 :]) * itemsize for d in range(len(shape)))


def _sum_pairs(pairs: Iterable[tuple[int, int]]) -> tuple[int, int]:
    pairs = list(pairs)
    return sum(p[0] for p in pairs), sum(p[1] for p in pairs)


def _scatter(
    pieces: list[tuple[int, int, int]], fetch: list[ByteRun], buffers: Sequence[memoryview], dense: np.ndarray
) -> None:
    """Copy each piece from the fetched range holding it into its place in ``dense``."""
    k = 0
    for src, dst, n in sorted(pieces):
        while fetch[k].offset + fetch[k].length < src + n:
            k += 1
        at = src - fetch[k].offset
        dense[dst : dst + n] = np.frombuffer(buffers[k], np.uint8)[at : at + n]


Pieces = tuple[np.ndarray, np.ndarray, np.ndarray]  # source offsets, box offsets, lengths (bytes)


def page_fetch_runs(info: TensorInfo, pieces: Pieces) -> tuple[np.ndarray, np.ndarray]:
    """``(starts, lengths)`` (relative to the tensor) a local read fetches for ``pieces``: exactly
    their pages (clipped to the tensor), merged across gaps of at most MAPPED_GAP_BYTES while the
    extra stays within MAX_GAP_FRACTION — never the whole span between a box's first and last bytes."""
    src, _, length = pieces
    order = np.argsort(src, kind="stable")
    starts, lengths = page_run_arrays(src[order], length[order], info.offset, info.nbytes, PAGE_BYTES)
    return merge_run_arrays(starts, lengths, MAPPED_GAP_BYTES, int(MAX_GAP_FRACTION * int(length.sum())))


def charged_page_bytes(
    info: TensorInfo, pieces: Pieces, shared: Pieces, starts: np.ndarray, lengths: np.ndarray
) -> int:
    """Bytes of the page runs ``starts, lengths`` (relative to the tensor) that a read of ``pieces``
    is charged with when sibling leaves read the same pages: each page in proportion to this leaf's
    bytes in it against the bytes of it that this leaf and its siblings read (``shared``, see
    :meth:`~otfload.plan.hooks.Hook.sibling_selection`); a page none of them needs (a merged gap)
    whole.

    GPT-OSS's ``gate`` and ``up`` read every other 1,440-byte row of ``gate_up_proj``: each 4 KiB page
    holds rows of both, is fetched from the disk once, by whichever leaf reads it first, and is in
    the page cache when the other reads it. Splitting each page between the siblings counts it once
    over them — what the kernel really reads (``/proc/self/io``) — instead of once per leaf, and
    charges both alike, so that both choose the same read layout (the split assumes they read the
    same pages). Bytes of a page that no sibling reads (other processes' rows) are charged as
    fetched: another host reads that page again."""
    if len(starts) == 0:
        return 0
    page, base = PAGE_BYTES, info.offset
    first_page = (base + starts) // page
    count = -(-(base + starts + lengths) // page) - first_page
    run = np.repeat(np.arange(len(starts)), count)
    k = np.arange(len(run)) - np.repeat(np.cumsum(count) - count, count)
    lo = np.maximum(starts[run], (first_page[run] + k) * page - base)
    hi = np.minimum(starts[run] + lengths[run], (first_page[run] + k + 1) * page - base)
    own = _covered(hi, pieces) - _covered(lo, pieces)
    theirs = _covered(hi, shared) - _covered(lo, shared)
    share = np.where(theirs > own, own / np.maximum(theirs, 1), 1.0)
    return int(round(float(((hi - lo) * share).sum())))


def _covered(x: np.ndarray, pieces: Pieces) -> np.ndarray:
    """Bytes of ``pieces`` (disjoint) below each of ``x``."""
    starts, _, lengths = pieces
    if len(starts) == 0:
        return np.zeros(len(x), np.int64)
    if np.any(starts[1:] < starts[:-1]):  # selection pieces come in row-major order: sorted already
        order = np.argsort(starts, kind="stable")
        starts, lengths = starts[order], lengths[order]
    before = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    j = np.maximum(np.searchsorted(starts, x, side="right") - 1, 0)
    return np.where(x > starts[0], before[j] + np.clip(x - starts[j], 0, lengths[j]), 0)


# What a page read is charged with when sibling leaves read the same pages: ``(the leaf's own exact
# selection, the selection it and its siblings read)`` — the first even when the read fetches the
# whole box (a selection too fragmented to read apart).
Charge = tuple[Selection, Selection]


def _charged(
    info: TensorInfo, box: Box, charge: Charge, starts: np.ndarray, lengths: np.ndarray, read: Selection | None,
    pieces: Pieces,
) -> int:
    """:func:`charged_page_bytes` of a read of ``read`` (None: the box) whose ``pieces`` are known."""
    if charge[0] == charge[1]:  # no sibling fills a hole: every page counts
        return int(lengths.sum())
    own = pieces if read == charge[0] else selection_piece_arrays(info.shape, info.dtype.itemsize, charge[0], box)
    shared = selection_piece_arrays(info.shape, info.dtype.itemsize, charge[1], box)
    return charged_page_bytes(info, own, shared, starts, lengths)


def _charge(selection: Selection | None, shared: Selection | None) -> Charge | None:
    return (selection, shared) if selection is not None and shared is not None else None


def _sibling_bytes(info: TensorInfo, charge: Charge | None) -> int:
    """Bytes of the elements sibling leaves read besides this one's (their rows between its rows)."""
    if charge is None or charge[0] == charge[1]:
        return 0
    return max(0, selection_size(charge[1]) - selection_size(charge[0])) * info.dtype.itemsize


def _with_shared(
    info: DerivedTensor, box: Box, selection: Selection, shared: Selection | None
) -> list[tuple[str, tuple[TensorInfo | DerivedTensor, Box, Selection], Selection | None]]:
    """``(role, (part, part box, part selection), part's shared selection or None)`` of each part."""
    parts = part_selections(info, box, selection)
    theirs = part_selections(info, box, shared) if shared is not None else {}
    return [(role, p, theirs[role][2] if role in theirs else None) for role, p in parts.items()]


def _span(info: TensorInfo, box: Box, pieces: Pieces, siblings: int = 0) -> tuple[int, int] | None:
    """``(start, length)`` of one read from the box's first element to its last selected byte, when
    the gaps it reads are small enough to save the requests; else None. ``siblings``: bytes in the
    gaps that sibling leaves of this process read anyway (not other processes' share)."""
    src, _, length = pieces
    if len(src) < 2:
        return None
    itemsize = info.dtype.itemsize
    start = sum(b[0] * s for b, s in zip(box, element_strides(info.shape, itemsize), strict=True))
    end = int((src + length).max())
    needed = int(length.sum())
    extra = end - start - needed
    if extra <= min(BOX_SPAN_GAP_BYTES * (len(src) - 1), MAX_GAP_FRACTION * needed + siblings):
        return start, end - start
    return None


class _PendingRead(NamedTuple):
    """A plain tensor's box, planned: the reads to send, the bytes they fetch, and what makes the
    box once they are in."""

    reads: list[RangeRead]
    fetched: int
    finish: Callable[[], np.ndarray]
    charged: bool = False  # ``fetched`` is a share of pages sibling leaves read too: it counts, not the source's


def _counting(charged: bool) -> Callable[..., AbstractContextManager[None]]:
    """How a read is metered: as the source records it, or (pages shared with sibling leaves) as
    the share it is charged with, whatever the source records inside."""
    return fetching if charged else expected_fetch


class TensorReader:
    """Reads boxes of tensors from a :class:`~otfload.sources.Source`."""

    def __init__(self, source: Source, stats: ReadStats | None = None):
        self.source = source
        self.stats = stats or ReadStats()
        self._mapping = source if isinstance(source, MappedSource) else None
        self._ranges_prefetch = source if isinstance(source, RangePrefetchingSource) else None
        self._direct = source if isinstance(source, DirectSource) else None
        self.direct_files: frozenset[str] = frozenset()  # read with O_DIRECT (see use_direct)
        self.ahead: ReadAheadRuns | None = None  # their runs read ahead (otfload.read.direct_ahead)

    def use_direct(self, files: Iterable[str]) -> frozenset[str]:
        """Read ``files`` (cold ones) with ``O_DIRECT`` from now on, those the source can; returns them.
        A load with ``direct_io=False`` (``OTFLOAD_DIRECT_IO=0``) does not call this: every file then
        goes through the page cache."""
        direct = self._direct
        if direct is None:
            return self.direct_files
        self.direct_files = frozenset(f for f in files if direct.direct_capable(f))
        return self.direct_files

    @property
    def maps(self) -> bool:
        """Whether this reader's source maps files (reads become page-cache views, fetched by page)."""
        return self._mapping is not None and self._mapping.use_mmap

    @property
    def pages(self) -> bool:
        """Whether the source reads local files, which the kernel fetches in whole pages."""
        return isinstance(self.source, PageGranularSource) and self.source.page_granular

    def read_box(
        self, info: TensorInfo | DerivedTensor, box: Box, arena: Arena, selection: Selection | None = None,
        shared: Selection | None = None,
    ) -> np.ndarray:
        """The elements of ``info`` inside ``box``, as an array of the box's shape (in scratch).

        With ``selection`` (inside ``box``), only the selected elements are fetched; the others hold
        arbitrary values (zeros or neighbouring bytes) and must not be used. ``shared`` (a superset of
        ``selection``) adds the elements sibling leaves read: pages holding them are theirs to count
        (:func:`charged_page_bytes`).
        """
        useful = useful_selection(info, box, selection)
        if is_derived(info):
            if useful is not None:
                return self._read_derived_selection(info, box, arena, useful, shared)
            parts = info.part_boxes(box)
            return info.decode({role: self.read_box(part, pbox, arena) for role, (part, pbox) in parts.items()}, box)
        return self._read_plain(info, box, arena, useful, view_ok=True, charge=_charge(selection, shared))

    def _fetch_plan(
        self, info: TensorInfo, box: Box, pieces: Pieces, view_ok: bool, charge: Charge | None = None
    ) -> tuple[str, np.ndarray, np.ndarray]:
        """How :meth:`read_box` fetches ``pieces`` (see :func:`selection_piece_arrays`): the mode and
        the ranges (``starts, lengths`` relative to the tensor) it asks the source for.

        Remotely, a selection whose holes are sibling leaves' elements (GPT-OSS's interleaved
        ``gate``/``up`` rows: every other 1,440-byte row) is read as one span: the siblings' rows are
        fetched twice (once per leaf) instead of one request per row (GPT-OSS-120B: ~750 k
        requests per process). Holes of other processes' elements stay unread."""
        if (view_ok and self.maps) or self.pages:
            return ("mapped" if view_ok and self.maps else "pages"), *page_fetch_runs(info, pieces)
        span = _span(info, box, pieces, _sibling_bytes(info, charge))
        if span is not None:
            return "span", np.array([span[0]], np.int64), np.array([span[1]], np.int64)
        return "pieces", pieces[0], pieces[2]

    def _source_fetches(
        self, starts: np.ndarray, lengths: np.ndarray, mode: str, charged: int | None = None
    ) -> tuple[int, int]:
        """``(bytes, requests)`` the source fetches for the ranges the reader asks in ``mode``: a
        remote source merges the pieces of one ``read_many`` (:func:`~otfload.accounting.requests.remote_fetch`);
        page reads of a selection with holes count ``charged`` (:func:`charged_page_bytes`)."""
        if charged is not None:
            return charged, len(lengths)
        if mode != "pieces" or self.pages or len(starts) < 2:
            return int(lengths.sum()), len(lengths)
        order = np.argsort(starts, kind="stable")
        _, merged, requests = remote_fetch(starts[order], lengths[order], PLANNED_GAPS)
        return int(merged.sum()), requests

    def read_boxes(
        self, infos: Sequence[TensorInfo | DerivedTensor], box: Box, arena: Arena, selection: Selection | None = None,
        shared: Selection | None = None,
    ) -> list[np.ndarray]:
        """:meth:`read_box` of ``box`` (``selection`` in it) of each of ``infos`` (the stacked tensors
        of one chunk of layers or experts). From a remote source the stored tensors' ranges go to
        the source in one ``read_many``, so their requests are in flight together instead of one
        tensor's after another's; mapped and local files are read tensor by tensor."""
        if self.maps or self.pages:
            return [self.read_box(info, box, arena, selection, shared) for info in infos]
        out: list[np.ndarray | None] = [None] * len(infos)
        pending: list[tuple[int, _PendingRead]] = []
        for k, info in enumerate(infos):
            if is_derived(info):
                out[k] = self.read_box(info, box, arena, selection, shared)
            else:
                useful = useful_selection(info, box, selection)
                pending.append((k, self._start_plain(info, box, arena, useful, True, _charge(selection, shared))))
        reads = [r for _, p in pending for r in p.reads]
        if reads:
            fetched = sum(p.fetched for _, p in pending)
            with expected_fetch(fetched, len(reads)):
                read_many(self.source, reads, PLANNED_GAPS)  # the gaps are others' bytes
        for k, p in pending:
            out[k] = p.finish()
        return [a for a in out if a is not None]

    def _read_plain(
        self, info: TensorInfo, box: Box, arena: Arena, selection: Selection | None, view_ok: bool,
        charge: Charge | None = None,
    ) -> np.ndarray:
        p = self._start_plain(info, box, arena, selection, view_ok, charge)
        if p.reads:  # a span (the box is a strided view of it) is chunked and fetched in parallel too
            with _counting(p.charged)(p.fetched, len(p.reads)):
                read_many(self.source, p.reads, PLANNED_GAPS)  # the gaps are others' bytes
        return p.finish()

    def _start_plain(
        self, info: TensorInfo, box: Box, arena: Arena, selection: Selection | None, view_ok: bool,
        charge: Charge | None = None,
    ) -> _PendingRead:
        """What reading ``box`` of ``info`` asks the source for (none for a mapped view, which is
        prefetched here), and how the box is made from the bytes once they are in."""
        arrays = selection_piece_arrays(info.shape, info.dtype.itemsize, selection or box_selection(box), box)
        needed = int(arrays[2].sum())
        direct = info.file in self.direct_files
        mode, *ranges = self._fetch_plan(info, box, arrays, view_ok and not direct, charge)
        mapped = self._mapped(info) if mode == "mapped" else None
        if mode == "mapped" and mapped is None:  # every mapping slot in use: read it instead
            mode, *ranges = self._fetch_plan(info, box, arrays, False, charge)
        fetch = [ByteRun(s, n) for s, n in zip(ranges[0].tolist(), ranges[1].tolist(), strict=True)]
        pieces = list(zip(*(a.tolist() for a in arrays), strict=True))
        fetched = sum(r.length for r in fetch)
        charged = charge is not None and mode in ("mapped", "pages")
        if charge is not None and charged:  # pages sibling leaves read too
            fetched = _charged(info, box, charge, ranges[0], ranges[1], selection, arrays)
            needed = selection_size(charge[0]) * info.dtype.itemsize  # the leaf's own elements, not the box
        self.stats.add(info.file, fetched, needed, len(fetch))
        strides = element_strides(info.shape, info.dtype.itemsize)
        if mapped is not None:
            if fetch:
                spans = [(info.offset + run.offset, run.length) for run in fetch]
                with _counting(charged)(fetched, len(fetch)):
                    if self._ranges_prefetch is not None:
                        self._ranges_prefetch.prefetch_ranges(info.file, spans)
                    elif self._mapping is not None:
                        for offset, length in spans:
                            self._mapping.prefetch(info.file, offset, length)
            whole = np.frombuffer(mapped, info.dtype, math.prod(info.shape), info.offset).reshape(info.shape)
            view = whole[box_to_slices(box)]
            return _PendingRead([], 0, lambda: view)
        origin = sum(b[0] * st for b, st in zip(box, strides, strict=True))
        read_direct = direct and mode == "pages"  # the takes below read their run themselves (O_DIRECT)
        take = self._direct_taker(info, fetch, arena, charged, fetched) if read_direct else arena.take
        end = origin + sum((b[1] - b[0] - 1) * st for b, st in zip(box, strides, strict=True)) + info.dtype.itemsize
        # one run holding the whole box (a selection's run may stop short of the box's end)
        if len(fetch) == 1 and fetch[0].offset <= origin and end <= sum(fetch[0]) and mode != "pieces":
            run = fetch[0]
            buffer = take(run.length)
            read = RangeRead(info.file, info.offset + run.offset, buffer.data)
            return _PendingRead([] if read_direct else [read], fetched, lambda: np.ndarray(
                box_shape(box), info.dtype, buffer=buffer, offset=origin - run.offset, strides=strides), charged)
        dense = arena.take(box_nbytes(box, info.dtype.itemsize))
        if selection is not None:
            dense[:] = 0  # the holes: defined values for hooks and decoders that touch the whole box
        if mode == "pieces":
            targets = [dense[dst : dst + n].data for _, dst, n in pieces]
        else:  # page ranges hold the pieces and more: read them apart, then copy the pieces out
            targets = [take(run.length).data for run in fetch]
        reads = [RangeRead(info.file, info.offset + run.offset, t) for run, t in zip(fetch, targets, strict=True)]

        def finish() -> np.ndarray:
            if mode != "pieces":
                _scatter(pieces, fetch, targets, dense)
            return dense.view(info.dtype).reshape(box_shape(box))

        return _PendingRead([] if read_direct else reads, fetched, finish, charged)

    def _direct_taker(
        self, info: TensorInfo, fetch: list[ByteRun], arena: Arena, charged: bool, fetched: int
    ) -> Callable[[int], np.ndarray]:
        """A ``take`` for :meth:`_start_plain` that hands out, run after run of ``fetch``, that run's
        bytes already read with ``O_DIRECT``: each run is widened to the block alignment, read into
        aligned scratch (or taken as read ahead, :attr:`ahead`), and the run's own bytes are the view
        handed out."""
        direct = cast(DirectSource, self._direct)  # direct_files holds files of a DirectSource only
        align, runs, ahead = direct.direct_align, iter(enumerate(fetch)), self.ahead

        def take(nbytes: int) -> np.ndarray:
            k, run = next(runs)
            start = (info.offset + run.offset) // align * align
            end = -(-(info.offset + run.offset + run.length) // align) * align
            charge = (fetched if k == 0 else 0) if charged else end - start  # a charged share counts once
            claimed = None if ahead is None else ahead.claim(info.file, start, end)
            if claimed is None:
                buffer, got = arena.take(end - start, align), None
            else:  # room in the read-ahead ring, held until the arena resets; read already, or to read into
                buffer, got, give_back = claimed
                arena.keep(give_back)
            if got is None:
                with _counting(charged)(charge):
                    got = direct.read_direct_into(info.file, start, buffer.data)
            else:  # read ahead: counted here as this read
                with _counting(charged)(charge), fetching(got):
                    pass
            at = info.offset + run.offset
            if got < at - start + run.length:
                raise TruncatedFileError(info.file, f"needs bytes [{at}, {at + run.length}) but ends at {start + got}")
            return buffer[at - start : at - start + nbytes]

        return take

    def _read_derived_selection(
        self, info: DerivedTensor, box: Box, arena: Arena, selection: Selection, shared: Selection | None = None
    ) -> np.ndarray:
        # Each part is read with its part selection (carried axis by axis, leaf_bytes.part_selections); never
        # as a mapped view (decoding touches the whole box: the holes' pages would be faulted in).
        arrays = {}
        for role, (part, pbox, psel), pshared in _with_shared(info, box, selection, shared):
            if is_derived(part):
                arrays[role] = self.read_box(part, pbox, arena, psel, pshared)
            else:  # a whole box may be a mapped view; never a selection (its holes' pages would fault in)
                useful = useful_selection(part, pbox, psel)
                arrays[role] = self._read_plain(part, pbox, arena, useful, useful is None, _charge(psel, pshared))
        return info.decode(arrays, box)

    def planned(
        self, info: TensorInfo | DerivedTensor, box: Box, selection: Selection | None = None, view_ok: bool = True,
        shared: Selection | None = None,
    ) -> tuple[int, int]:
        """``(bytes, requests)`` :meth:`read_box` asks the source for (``shared``: see there), computed
        without reading."""
        useful = useful_selection(info, box, selection)
        if is_derived(info):
            if useful is None:
                return _sum_pairs(self.planned(part, pbox) for part, pbox in info.part_boxes(box).values())
            return _sum_pairs(
                self.planned(part, pbox, psel, is_derived(part) or useful_selection(part, pbox, psel) is None, pshared)
                for _, (part, pbox, psel), pshared in _with_shared(info, box, useful, shared)
            )
        pieces = selection_piece_arrays(info.shape, info.dtype.itemsize, useful or box_selection(box), box)
        charge = _charge(selection, shared)
        mode, starts, lengths = self._fetch_plan(info, box, pieces, view_ok, charge)
        paged = charge is not None and mode in ("mapped", "pages")
        charged = _charged(info, box, charge, starts, lengths, useful, pieces) if charge and paged else None
        return self._source_fetches(starts, lengths, mode, charged)

    def fetch_ranges(
        self, info: TensorInfo | DerivedTensor, box: Box, selection: Selection | None = None
    ) -> list[tuple[str, int, int]]:
        """``(file, offset, length)`` of every range :meth:`read_box` of a mapping source will fetch
        for ``box`` (file offsets, page-merged as read), computed without reading: what a read-ahead
        announces. A derived tensor read with holes gives none (its parts' reads are not announced)."""
        selection = useful_selection(info, box, selection)
        if is_derived(info):
            if selection is not None:
                return []
            return [r for part, pbox in info.part_boxes(box).values() for r in self.fetch_ranges(part, pbox)]
        pieces = selection_piece_arrays(info.shape, info.dtype.itemsize, selection or box_selection(box), box)
        _, starts, lengths = self._fetch_plan(info, box, pieces, view_ok=True)
        return [(info.file, info.offset + s, n) for s, n in zip(starts.tolist(), lengths.tolist(), strict=True)]

    def _mapped(self, info: TensorInfo) -> memoryview | None:
        # The source checks that the file still holds the whole tensor before anything touches it.
        return self._mapping.mapped(info.file, info.offset, info.nbytes) if self._mapping is not None else None

    def release(self, info: TensorInfo | DerivedTensor, box: Box) -> None:
        """Done with ``box`` of ``info``: let a mapping source drop its pages from our memory."""
        if is_derived(info):
            for part, pbox in info.part_boxes(box).values():
                self.release(part, pbox)
            return
        runs = byte_runs(info.shape, info.dtype.itemsize, box)
        if self._mapping is not None and runs:
            start, end = runs[0].offset, runs[-1].offset + runs[-1].length
            self._mapping.release(info.file, info.offset + start, end - start)
