"""Cold files read with ``O_DIRECT`` ahead of the builders, into a bounded ring of scratch.

A builder reads the runs of a file it reads with ``O_DIRECT`` itself, just before copying them
(:meth:`~otfload.read.reader.TensorReader._direct_taker`): on its own the disk then waits while the
builder copies. A :class:`DirectAhead` thread walks the leaves in the order the builders take them
and reads each leaf's runs — the same block-aligned runs, computed as the builders compute them
(:meth:`~otfload.read.reader.TensorReader.fetch_ranges`) — into one ring of ``ring_bytes``, as far
ahead as the ring has room. A builder about to read a run claims it instead (:meth:`DirectAhead.claim`):

- read already: the run is a view of the ring, held until the builder's arena resets (its chunk is
  placed), then its room goes back to the thread: no read, and no copy more than before;
- being read: the builder waits for it;
- not reached yet (or larger than the ring): the builder reads it itself, and the thread skips it.

Host memory stays bounded by the ring (its pages are touched as runs land; they are reused run
after run). Accounting is unchanged: the thread records nothing, and a claimed run is counted by
the builder as if it had read it (:class:`~otfload.accounting.meter.FetchMeter`), so report and
meter count each byte once, as without the thread. It is advisory: a read that fails here is read
again by the builder, which reports the error.
"""

from __future__ import annotations

import contextlib
import heapq
import mmap
import threading
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import cast

import numpy as np
from jax.sharding import Sharding

from otfload.errors import OtfloadError
from otfload.pages import MADV_POPULATE_WRITE, madvise
from otfload.plan.planner import LoadPlan
from otfload.read.readahead import leaf_ranges
from otfload.read.reader import TensorReader
from otfload.sources.base import DirectSource

# The ring's share of the load's scratch budget (host_memory_budget, by default the largest leaf's
# source bytes); the builders' arenas keep the rest. Cold 1.1 GB Llama (largest leaf 234 MB), loaded
# machine, medians of 4: a ring of half the budget 1.63 s, of all of it 1.68 s, of a quarter 1.91 s;
# with the ring set aside from the builders' share (ByteBudget.set_aside), transient 0.13 GiB at half.
RING_SHARE = 0.5
# Reads in flight together: one O_DIRECT stream of 13 MiB runs read this VM's disk at 0.68 GB/s, two
# at 1.0, three at 1.09, four 8 MiB ones at 1.17 (medians of 3 cold passes over the 1.1 GB Llama).
READ_DEPTH = 3

Run = tuple[str, int, int]  # (file, start, end): block-aligned, as read with O_DIRECT
# A claimed run: its room in the ring, how many of its bytes the file held (None: not read yet, the
# claimer reads it into the room), and the call that gives the room back.
Claimed = tuple[np.ndarray, int | None, Callable[[], None]]


class _Ring:
    """Room in one buffer of ``size`` bytes, handed out in order and given back in any order (the
    room of a run given back before an older one is reused once the older one is given back too)."""

    def __init__(self, size: int):
        self.size = size
        self._live: deque[list[int]] = deque()  # [offset, size, given back], oldest first

    def take(self, nbytes: int) -> int | None:
        """The offset of ``nbytes`` of room, or None while there is not enough."""
        if not self._live:
            at = 0 if nbytes <= self.size else None
        else:
            tail, head = self._live[0][0], self._live[-1][0] + self._live[-1][1]
            if head > tail:  # not wrapped: room after the newest, then before the oldest
                at = head if head + nbytes <= self.size else 0 if nbytes <= tail else None
            else:
                at = head if head + nbytes <= tail else None
        if at is not None:
            self._live.append([at, nbytes, 0])
        return at

    def give_back(self, offset: int) -> None:
        for entry in self._live:
            if entry[0] == offset and not entry[2]:
                entry[2] = 1
                break
        while self._live and self._live[0][2]:
            self._live.popleft()


class _Entry:
    """One run the thread has reached: its room in the ring, and the bytes read (None: not yet)."""

    __slots__ = ("at", "done", "got", "size")

    def __init__(self, at: int | None, size: int):
        self.at, self.size = at, size  # at None: no room (larger than the ring): the builder reads it
        self.got: int | None = None  # bytes the file held; None with done: the read failed
        self.done = at is None


class DirectAhead:
    """Threads reading ``runs`` (in the order builders claim them; computed as they go) from
    ``source`` with ``O_DIRECT`` into a ring of ``ring_bytes``: one walks the runs and takes their
    room in order, ``depth`` read them, so that as many requests are in flight."""

    def __init__(self, source: DirectSource, runs: Iterable[Run], ring_bytes: int, depth: int = READ_DEPTH):
        self.source = source
        self._runs = runs
        self._ring = _Ring(ring_bytes // source.direct_align * source.direct_align)
        self._entries: dict[Run, deque[_Entry]] = {}  # reached by the walker, not claimed yet
        self._skip: Counter[Run] = Counter()  # claimed before the walker reached them: not to read
        self._queue: deque[tuple[Run, _Entry]] = deque()  # room taken, to read
        self._walking = True
        self._stop = False
        # One lock; the walker waits for room, readers for runs to read, builders for runs read: each
        # woken alone (waking every thread at every event cost ~0.1 CPU-s a 1 GB load).
        lock = threading.Lock()
        self._cond, self._room, self._work = (threading.Condition(lock) for _ in range(3))
        self._region: mmap.mmap | None = None
        self._buffer = np.empty(0, np.uint8)
        self._populated = 0  # bytes of the ring from its start whose pages are populated
        self.read_ahead = 0  # bytes the readers read, for tests and benchmarks
        self.claimed = 0  # bytes builders took from the ring as read
        self._threads = [threading.Thread(target=self._walk, name="otfload-direct-walk", daemon=True)]
        self._threads += [threading.Thread(target=self._read, name="otfload-direct-read", daemon=True)
                          for _ in range(max(1, depth))]  # fmt: skip

    @property
    def ring_bytes(self) -> int:
        """The ring's size: host memory it holds once its pages are populated."""
        return self._ring.size

    def start(self) -> DirectAhead:
        """Map the ring (its pages are populated as room is first handed out) and start the threads;
        without memory to map, no thread starts and the builders read everything themselves."""
        try:
            self._region = mmap.mmap(-1, max(self._ring.size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            self._stop = True
            return self
        self._buffer = np.frombuffer(self._region, np.uint8)
        for thread in self._threads:
            thread.start()
        return self

    def close(self) -> None:
        """Stop the threads (after the reads they are in) and wait for them; room already claimed
        stays valid."""
        with self._cond:
            self._stop = True
            for _, entry in self._queue:  # never to be read: a builder waiting on one reads it itself
                entry.done = True
            self._queue.clear()
            self._wake_all()
        for thread in self._threads:
            if thread.is_alive():
                thread.join()

    def __enter__(self) -> DirectAhead:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def unclaimed(self) -> int:
        """Runs the walker reached that no builder has claimed (0 after a load that read them all)."""
        with self._cond:
            return sum(len(q) for q in self._entries.values())

    def claim(self, file: str, start: int, end: int) -> Claimed | None:
        """Run ``[start, end)`` of ``file`` as read ahead (waiting while it is being read); a run the
        walker has not reached yet is skipped by it, and given room in the ring to read it into
        when there is some; None: no room (or the read ahead failed), the caller reads it elsewhere."""
        run, size = (file, start, end), end - start
        with self._cond:
            queue = self._entries.get(run)
            if not queue:
                if self._stop:
                    return None
                self._skip[run] += 1
                self._room.notify()  # the walker, waiting for room for this run, goes on to the next
                at, got = self._ring.take(size), None
                if at is None:
                    return None
                fresh = self._unpopulated(at + size)
            else:
                entry = queue.popleft()
                if not queue:
                    del self._entries[run]
                self._cond.wait_for(lambda: entry.done)
                if entry.at is None:
                    return None
                if entry.got is None:
                    self._give_back_locked(entry.at)
                    return None
                at, got, fresh = entry.at, entry.got, None
                self.claimed += size
        self._populate(fresh)
        return self._buffer[at : at + size], got, lambda: self._give_back(at)

    def _unpopulated(self, end: int) -> tuple[int, int] | None:
        """The part of the ring below ``end`` whose pages are not populated yet, marked populated
        (room is handed out from the start, so the populated part is a prefix); lock held."""
        if end <= self._populated:
            return None
        fresh, self._populated = (self._populated, end), end
        return fresh

    def _populate(self, fresh: tuple[int, int] | None) -> None:
        """Populate the pages of ``fresh`` at once (``MADV_POPULATE_WRITE``, without the GIL or the
        lock): on this VM 3x cheaper than the faults an ``O_DIRECT`` read into fresh pages takes."""
        if fresh is not None and self._region is not None:
            with contextlib.suppress(OSError, ValueError):  # kernels before 5.14: the reads fault them in
                madvise(self._region, fresh[0], fresh[1] - fresh[0], MADV_POPULATE_WRITE)

    def _give_back(self, at: int) -> None:
        with self._cond:
            self._give_back_locked(at)

    def _give_back_locked(self, at: int) -> None:
        self._ring.give_back(at)
        self._room.notify()

    def _wake_all(self) -> None:
        """Wake every waiting thread (stopped, or the walk ended); lock held."""
        for condition in (self._cond, self._room, self._work):
            condition.notify_all()

    def _reach(self, run: Run) -> None:
        """Take room for ``run`` (waiting for it), then queue it to be read; an entry without room
        when it is larger than the ring; nothing when stopped or claimed meanwhile."""
        size = run[2] - run[1]
        with self._cond:
            at = None
            while not self._stop and not self._skip[run]:
                at = self._ring.take(size) if size <= self._ring.size else None
                if at is not None or size > self._ring.size:
                    break
                self._room.wait()  # for room; meanwhile a builder may claim the run and read it itself
            if self._skip[run]:
                self._skip[run] -= 1
                if at is not None:
                    self._give_back_locked(at)
                return
            if self._stop:
                return
            entry = _Entry(at, size)
            self._entries.setdefault(run, deque()).append(entry)
            if at is None:
                return
            fresh = self._unpopulated(at + size)
        self._populate(fresh)
        with self._cond:
            if self._stop:  # closed meanwhile: a builder waiting on it reads it itself
                entry.done = True
                self._cond.notify_all()
            else:
                self._queue.append((run, entry))
                self._work.notify()

    def _walk(self) -> None:
        runs = iter(self._runs)
        try:
            while not self._stop:
                run = next(runs, None)
                if run is None:
                    return
                self._reach(run)
        except (OtfloadError, ValueError):  # advisory: the builders compute and read their runs anyway
            return
        finally:
            with self._cond:
                self._walking = False
                self._wake_all()

    def _read(self) -> None:
        while True:
            with self._cond:
                self._work.wait_for(lambda: self._queue or self._stop or not self._walking)
                if not self._queue:
                    return
                run, entry = self._queue.popleft()
            got: int | None = None
            try:
                at = cast(int, entry.at)
                got = self.source.read_direct_into(run[0], run[1], self._buffer[at : at + entry.size].data)
            except (OtfloadError, OSError):  # the builder reads it again and reports it
                pass
            finally:  # whatever happened, no builder waits on it any longer
                with self._cond:
                    entry.got, entry.done = got, True
                    self.read_ahead += got or 0
                    self._cond.notify_all()


def direct_runs(
    plan: LoadPlan, reader: TensorReader, order: Sequence[str], shardings: Mapping[str, Sharding | None],
    builders: int, align: int,
) -> Iterator[Run]:
    """The block-aligned runs the builders read with ``O_DIRECT`` through ``reader`` for the leaves
    ``order`` (leaf ``path`` read under ``shardings[path]``, default its own), in the order
    ``builders`` threads taking the leaves in turn would read them if each read at the same rate:
    the next run is always that of the builder that has read the fewest bytes so far."""
    def runs_of(path: str) -> Iterator[Run]:
        for file, offset, length in leaf_ranges(plan.leaves[path], reader, shardings.get(path)):
            if file in reader.direct_files:
                yield file, offset // align * align, -(-(offset + length) // align) * align

    leaves = iter(order)
    # per builder: [bytes read so far, its leaf's runs left]; the builder that read the fewest goes next
    slots: list[tuple[int, int, Iterator[Run]]] = []
    for k in range(max(1, builders)):
        path = next(leaves, None)
        if path is None:
            break
        slots.append((0, k, runs_of(path)))
    heapq.heapify(slots)
    while slots:
        read, k, runs = slots[0]
        run = next(runs, None)
        while run is None:  # this builder's leaf is done: it takes the next one
            path = next(leaves, None)
            if path is None:
                heapq.heappop(slots)
                break
            runs = runs_of(path)
            run = next(runs, None)
        if run is None:
            continue
        heapq.heapreplace(slots, (read + run[2] - run[1], k, runs))
        yield run


def start_direct_ahead(
    plan: LoadPlan, reader: TensorReader, order: Sequence[str], scratch_budget: int | None,
    shardings: Mapping[str, Sharding | None] | None = None, builders: int = 1,
) -> DirectAhead | None:
    """A started :class:`DirectAhead` for ``plan``'s leaves in ``order``, taken by ``builders``
    threads (:func:`direct_runs`), its ring :data:`RING_SHARE` of the load's ``scratch_budget`` (the
    host memory budget: by default the largest leaf's source bytes), made the reader's
    (:attr:`~otfload.read.reader.TensorReader.ahead`), when the reader reads files with ``O_DIRECT``;
    else None."""
    source = reader.source
    ring = int((scratch_budget or 0) * RING_SHARE)
    if not reader.direct_files or not isinstance(source, DirectSource) or ring < source.direct_align:
        return None
    runs = direct_runs(plan, reader, order, shardings or {}, builders, source.direct_align)
    ahead = DirectAhead(source, runs, ring)
    reader.ahead = ahead
    return ahead.start()
