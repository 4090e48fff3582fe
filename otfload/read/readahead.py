"""Read-ahead for local files on a cold page cache: the disk reads the next leaves while builders copy.

Builders fetch each tensor's ranges just before copying them (``fadvise(WILLNEED)`` then
``MADV_POPULATE_READ``, :mod:`otfload.sources.local`): on a cold cache each builder then waits for
the disk, and the disk idles while the builders copy and place. A :class:`ReadAhead` thread walks
the plan in the order the loader submits leaves and announces each leaf's exact fetch ranges
(:meth:`~otfload.read.reader.TensorReader.fetch_ranges`, the same page runs the builder will fetch)
with ``posix_fadvise(WILLNEED)``, which queues the reads and returns; it stays at most
``lead_bytes`` ahead of the last leaf a builder started. Within a leaf the ranges go in file order,
so the disk sees long ascending runs.

The strategy is chosen from the cache state (:func:`~otfload.sources.residency.choose_strategy`),
first per file — a sampled ``mincore`` of each file (:func:`cold_files`, ~2 ms for a 1 GB
checkpoint): with every file warm no thread starts and no range is computed (computing them cost
~0.15 s of a 1 s warm load) — then per range: a range ``mincore`` finds resident is skipped.

Accounting stays exact: the thread announces only ranges that builders will fetch and count
(:class:`~otfload.accounting.meter.FetchMeter`), so the disk reads each byte once and the report
counts it once. It is advisory: any failure only loses the head start (the builder's own read then
fetches and reports the error).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple, Protocol

from jax.sharding import Sharding

from otfload.errors import OtfloadError
from otfload.plan.leaf_bytes import leaf_reads
from otfload.plan.planner import LeafPlan, LoadPlan
from otfload.read.reader import TensorReader
from otfload.sources.base import ResidencySource, Source
from otfload.sources.residency import SAMPLE_PAGES, Strategy, choose_strategy

# How far (in bytes announced) the thread runs ahead of the leaves started. The page cache holds
# these bytes (not the process: RSS does not grow), so the bound is about not evicting pages before
# use under memory pressure; 512 MiB is ~0.25 s of this VM's disk (2 GB/s), enough to keep it busy
# while both builders copy a leaf. On the 1 GiB Llama checkpoint, cold, 128 MiB / 512 MiB / 4 GiB
# measured alike (1.8-2.3 / 1.45-2.3 / 1.5-2.1 s: within the spread; docs/benchmarks.md).
LEAD_BYTES = 512 << 20

# Set to "0" to turn read-ahead off (benchmarks compare both; the default is on).
READ_AHEAD_ENV = "OTFLOAD_READ_AHEAD"

Range = tuple[str, int, int]  # (file, offset, length)


class ResidentFiles(Source, ResidencySource, Protocol):
    """A source of local files that says which pages are resident and takes read-ahead advice."""


class ReadAhead:
    """A thread announcing to ``source`` the ranges ``ranges_of(path)`` of each of ``leaves``
    (``[(leaf path, bytes)]``, in build order; ranges are computed by the thread as it goes)."""

    def __init__(
        self,
        source: ResidencySource,
        leaves: Sequence[tuple[str, int]],
        ranges_of: Callable[[str], Sequence[Range]],
        lead_bytes: int = LEAD_BYTES,
    ):
        self.source = source
        self.lead_bytes = lead_bytes
        self._leaves = list(leaves)
        self._ranges_of = ranges_of
        self._position = {path: i for i, (path, _) in enumerate(self._leaves)}
        sizes = [n for _, n in self._leaves]
        self._before = [0]  # bytes of the leaves before each leaf
        for n in sizes:
            self._before.append(self._before[-1] + n)
        self._started = 0  # index of the latest leaf a builder started
        self._stop = False
        self._cond = threading.Condition()
        self.announced = 0  # bytes announced (cold ranges), for tests and benchmarks
        self.skipped = 0  # bytes found resident and not announced
        self._thread = threading.Thread(target=self._run, name="otfload-readahead", daemon=True)

    def start(self) -> ReadAhead:
        self._thread.start()
        return self

    def started(self, path: str) -> None:
        """A builder started leaf ``path``: the thread may run ``lead_bytes`` past its start."""
        i = self._position.get(path)
        if i is None:
            return
        with self._cond:
            if i > self._started:
                self._started = i
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every range has been announced or skipped (or the thread stopped); True if so."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        """Stop the thread (after its current system call) and wait for it."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wait_for_room(self, i: int) -> bool:
        """Wait until leaf ``i`` is within the lead; False once stopped."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._stop or self._before[i] - self._before[self._started] <= self.lead_bytes
            )
            return not self._stop

    def _run(self) -> None:
        with contextlib.suppress(OtfloadError, OSError, ValueError):  # advisory: the builder reads anyway
            for i, (path, _) in enumerate(self._leaves):
                if not self._wait_for_room(i):
                    return
                for file, offset, length in sorted(self._ranges_of(path)):
                    if self._stop:
                        return
                    resident = self.source.resident_fraction(file, offset, length)
                    if choose_strategy(resident, length) is Strategy.MAP:
                        self.skipped += length
                        continue
                    self.source.advise(file, [(offset, length)])
                    self.announced += length


class Residency(NamedTuple):
    """What the page cache holds of a checkpoint's safetensors files, from a sample of each."""

    cold: set[str]  # the files worth reading ahead (choose_strategy)
    resident: float | None  # the fraction of their bytes resident; None: not known for some file


def probe_residency(source: ResidentFiles) -> Residency:
    """Each safetensors file's residency estimated from SAMPLE_PAGES pages (~0.1 ms a file)."""
    cold: set[str] = set()
    held, total, unknown = 0.0, 0, False
    for file in source.list_files():
        if not file.endswith(".safetensors"):
            continue
        # Advisory: a file that cannot be probed is not read ahead (the builder reports its error if the plan uses it).
        with contextlib.suppress(OtfloadError, OSError):
            size = source.size(file)
            resident = source.resident_fraction(file, 0, size, max_pages=SAMPLE_PAGES)
            if choose_strategy(resident, size) is Strategy.READ_AHEAD:
                cold.add(file)
            unknown |= resident is None
            held, total = held + (resident or 0.0) * size, total + size
    return Residency(cold, None if unknown or not total else held / total)


def cold_files(source: ResidentFiles) -> set[str]:
    """The safetensors files of ``source`` worth reading ahead, judged per file by
    :func:`~otfload.sources.residency.choose_strategy` (:func:`probe_residency`)."""
    return probe_residency(source).cold


def local_residency(reader: TensorReader) -> Residency | None:
    """:func:`probe_residency` of ``reader``'s source when it reads local files and knows their
    residency; None otherwise (not local, or no ``mincore``)."""
    source = reader.source
    if not (reader.maps or reader.pages) or not isinstance(source, ResidencySource):  # narrows the type
        return None
    return probe_residency(source)


def leaf_ranges(leaf_plan: LeafPlan, reader: TensorReader, sharding: Sharding | None = None) -> list[Range]:
    """The ranges the builder of ``leaf_plan`` fetches through ``reader`` on this process, the leaf
    read under ``sharding`` (default: its own)."""
    boxes = leaf_plan.device_boxes(sharding=sharding)
    if not boxes or not leaf_plan.sources:
        return []
    union, selection, indices = leaf_reads(leaf_plan, boxes)
    return [r for i in indices for r in reader.fetch_ranges(leaf_plan.sources[i], union, selection)]


def start_read_ahead(
    plan: LoadPlan, reader: TensorReader, shardings: Mapping[str, Sharding | None] | None = None,
    cold: set[str] | None = None, lead_bytes: int = LEAD_BYTES,
) -> ReadAhead | None:
    """A started :class:`ReadAhead` for ``plan``'s leaves (in plan order, leaf ``path`` read under
    ``shardings[path]``) when ``reader``'s source reads local files, else None; ``cold``: the files
    worth reading ahead when already probed (:func:`local_residency`)."""
    source = reader.source
    if not (reader.maps or reader.pages) or not isinstance(source, ResidencySource):  # narrows the type
        return None
    cold = cold_files(source) if cold is None else cold
    if not cold:  # a warm cache: no thread, no range computed (measured: that cost 0.15 s of 1.0 s warm)
        return None
    shardings = shardings or {}
    leaves = [(path, p.source_bytes) for path, p in plan.leaves.items()]

    def ranges_of(path: str) -> list[Range]:
        return [r for r in leaf_ranges(plan.leaves[path], reader, shardings.get(path)) if r[0] in cold]

    return ReadAhead(source, leaves, ranges_of, lead_bytes).start()
