"""A checkpoint in a local directory: memory-mapped read-only (zero-copy views), or read with ``os.preadv``.

Mapping lets the builder copy each byte once, straight from the page cache into its final buffer;
mapped pages count in the process's RSS until released, so callers release each range when done.

Open files are a bounded pool: at most :attr:`LocalSource.max_open_files` descriptors (half of them
for mappings), derived from the process's ``RLIMIT_NOFILE``, least recently used first out and
reopened on demand, so a checkpoint with more shards than the descriptor limit still loads. A
descriptor is closed only when no thread is using it; a mapping is handed out only as a
``memoryview``, which Python refuses to unmap while any view of it lives: an evicted mapping whose
views are still in use is unmapped when the last one goes.

A cold file (not in the page cache) can be read with ``O_DIRECT`` instead (:meth:`LocalSource.read_direct_into`):
the disk writes straight into the caller's aligned buffer, so the kernel neither fills nor manages page
cache pages for it (cold ``benchmarks/cold_strategies.py`` on 2 vCPU: 0.64-0.98 CPU-s per GiB copied
into fresh buffers against 0.96-1.32 through the mapping) and a large checkpoint read once does not
push everything else out of the page cache. A file system that refuses ``O_DIRECT`` (EINVAL at open:
some network and FUSE file systems; tmpfs on older kernels) is read as before.

Files are checked, never trusted: a name that is a directory, a FIFO or a device is refused (a FIFO
is opened non-blocking, so it cannot hang the load), a file replaced since it was first opened (another
inode) is refused, and before any byte of a mapping is touched the file's current size must cover
the tensor. Touching a mapped page beyond the end of a truncated file would kill the process with
SIGBUS; here a file truncated after planning is a :class:`~otfload.errors.TruncatedFileError` naming
the bytes expected and present. Only a truncation in the microseconds between that check (and the
page-table populate that follows it) and the copy can still fault: load files that another process
may be rewriting with ``mmap=False``, where every read is a ``preadv`` (one more copy).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import resource
import stat
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from otfload.accounting.gaps import DEFAULT_GAPS, GapPolicy
from otfload.accounting.meter import fetching
from otfload.errors import (
    CorruptFileError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    SourceUnavailableError,
    TruncatedFileError,
)
from otfload.pages import MADV_POPULATE_READ, madvise
from otfload.sources.base import RangeRead
from otfload.sources.residency import resident_fraction

# Ranges about to be read are announced with posix_fadvise(WILLNEED) in pieces of at most this size:
# the kernel then reads those pages and no more. Measured on this VM (read_ahead_kb 8192): a 1 MiB
# MADV_POPULATE_READ alone fetched 8 MiB from disk (read-around), one 32 MiB advice then a read 40-44
# MiB, 8 MiB pieces exactly 32 MiB, as fast (28 ms populate, 41 ms preadv per 32 MiB cold).
ADVISE_CHUNK_BYTES = 8 << 20
# A source takes at most this fraction (1/N) of the process's descriptor limit: the rest stays for
# sockets, JAX, the shard cache, other sources and the caller's own files.
FD_LIMIT_SHARE = 2
# Two open files and two mappings: enough for progress, as a thread uses one file at a time.
MIN_OPEN_FILES = 4
# More descriptors than this buy nothing: the largest checkpoints have a few hundred shard files.
MAX_OPEN_FILES = 4096
# O_NONBLOCK: opening a FIFO for reading must not wait for a writer (cleared again for regular files).
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
# O_DIRECT transfers must start, end and land on multiples of the device's logical block size (512 B
# or 4 KiB): 4 KiB serves both.
DIRECT_ALIGN = 4096
# Reads failing with these mean the process (or system) ran out of descriptors, not a bad file.
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)


def default_max_open_files() -> int:
    """Descriptors one source may hold: ``1 / FD_LIMIT_SHARE`` of the soft ``RLIMIT_NOFILE``, bounded."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_FILES
    return max(MIN_OPEN_FILES, min(MAX_OPEN_FILES, soft // FD_LIMIT_SHARE))


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a device or special file"


@dataclass
class _Open:
    """One open file of the pool: its descriptor, its mapping (if made) and the threads using it."""

    fd: int
    region: mmap.mmap | None = None
    users: int = 0


class LocalSource:
    """Files under a local directory, read through a bounded pool of descriptors shared by threads."""

    page_granular = True  # the kernel reads these files in whole pages: readers plan their ranges so
    # Declared here, where ``mmap`` is still the module (``__init__``'s parameter of that name hides it).
    _regions: weakref.WeakSet[mmap.mmap]  # mapped, ours or kept by views

    def __init__(self, root: str | os.PathLike[str], *, mmap: bool = True, max_open_files: int | None = None):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise SourceNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
        self.use_mmap = mmap
        self.max_open_files = max(MIN_OPEN_FILES, max_open_files or default_max_open_files())
        # Every live mapping holds its own descriptor (Python's mmap dups it): half of the pool each.
        self._max_maps = self.max_open_files // 2
        self._max_fds = self.max_open_files - self._max_maps
        self._open: OrderedDict[str, _Open] = OrderedDict()  # least recently used first
        self._regions = weakref.WeakSet()
        self._identity: dict[str, tuple[int, int]] = {}  # (device, inode) when first opened
        self._cond = threading.Condition()
        self._populate = True  # cleared when the kernel predates MADV_POPULATE_READ
        self._direct: dict[str, bool] = {}  # file -> whether its file system takes O_DIRECT (probed once)

    @property
    def description(self) -> str:
        return str(self.root)

    def list_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file() and ".cache" not in p.parts
        )

    @property
    def open_files(self) -> int:
        """Descriptors this source holds now: open files plus mappings (including evicted ones in use)."""
        with self._cond:
            return len(self._open) + len(self._regions)

    def _path(self, file: str) -> Path:
        try:
            path = (self.root / file).resolve()
        except (RuntimeError, OSError) as e:  # a symlink loop (RuntimeError before Python 3.13)
            raise SourceNotFoundError(f"{file!r} in {str(self.root)!r} cannot be resolved: {e}") from None
        if self.root not in path.parents:
            raise SourceNotFoundError(f"{file!r} is outside the checkpoint directory {str(self.root)!r}")
        return path

    # --- the pool ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _use(self, file: str) -> Iterator[_Open]:
        """The open file ``file``, kept open (not evicted) until the block ends."""
        with self._cond:
            entry = self._entry(file)
            entry.users += 1
        try:
            yield entry
        finally:
            with self._cond:
                entry.users -= 1
                self._cond.notify_all()

    def _entry(self, file: str) -> _Open:
        # Called with the lock held. Waits only for other threads' reads in progress, which hold a
        # file for one system call each and never wait on anything while holding it.
        while True:
            entry = self._open.get(file)
            if entry is not None:
                self._open.move_to_end(file)
                return entry
            if len(self._open) < self._max_fds or self._evict_one():
                break
            self._cond.wait()
        entry = _Open(self._open_fd(file))
        self._open[file] = entry
        return entry

    def _evict_one(self) -> bool:
        """Close the least recently used idle file; False when every open file is in use."""
        for name, entry in self._open.items():
            if entry.users == 0:
                del self._open[name]
                self._unmap(entry)
                os.close(entry.fd)
                return True
        return False

    @staticmethod
    def _unmap(entry: _Open) -> None:
        region, entry.region = entry.region, None
        if region is not None:
            with contextlib.suppress(BufferError):  # views are alive: it is unmapped when they go
                region.close()

    def _open_fd(self, file: str) -> int:
        path = self._path(file)
        try:
            fd = self._os_open(path)
        except FileNotFoundError as e:
            raise SourceNotFoundError(f"{file!r} not found in {str(self.root)!r}") from e
        except PermissionError as e:
            raise SourcePermissionError(f"{file!r} in {str(self.root)!r}: permission denied") from e
        except OSError as e:
            if e.errno in _OUT_OF_FDS:
                raise SourceUnavailableError(
                    f"{file!r} in {str(self.root)!r}: the process is out of file descriptors "
                    f"(this source holds {len(self._open) + len(self._regions)}; raise `ulimit -n` "
                    f"or pass a smaller max_open_files)"
                ) from e
            raise SourceError(f"{file!r} in {str(self.root)!r}: cannot open ({e.strerror})") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SourceNotFoundError(f"{file!r} in {str(self.root)!r} is {_file_kind(st.st_mode)}, not a file")
            identity = (st.st_dev, st.st_ino)
            first = self._identity.setdefault(file, identity)
            if identity != first:
                raise CorruptFileError(file, "was replaced by another file (another inode) since it was first opened")
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _os_open(self, path: Path) -> int:
        try:
            return os.open(path, OPEN_FLAGS)
        except OSError as e:
            if e.errno not in _OUT_OF_FDS:
                raise
        # Other code took the descriptors: give back every idle one of ours, then try once more.
        while self._evict_one():
            pass
        return os.open(path, OPEN_FLAGS)

    def _check_covers(self, file: str, entry: _Open, offset: int, length: int) -> int:
        """The file's current size, which must cover ``[offset, offset + length)``."""
        size = os.fstat(entry.fd).st_size
        end = offset + length
        if end > size:
            raise TruncatedFileError(file, f"needs bytes [{offset}, {end}) but the file now has only {size} bytes")
        return size

    # --- mapped reads -----------------------------------------------------------------------------

    def mapped(self, file: str, offset: int = 0, length: int = 0) -> memoryview | None:
        """The whole file mapped read-only, as a view that keeps the mapping alive; None when mapping
        is off or every mapping slot is in use (read with :meth:`read_into` then).

        Raises :class:`TruncatedFileError` unless the file's current size covers ``[offset, offset + length)``.
        """
        if not self.use_mmap:
            return None
        # One lock section (fstat and mmap do no I/O): the entry cannot be evicted meanwhile, and the
        # mapping cap holds exactly.
        with self._cond:
            entry = self._entry(file)
            size = self._check_covers(file, entry, offset, length)
            region = entry.region
            if region is not None and len(region) >= offset + length:
                return memoryview(region)
            self._unmap(entry)  # made while the file was shorter: map it again
            if len(self._regions) >= self._max_maps:
                self._unmap_idle()
                if len(self._regions) >= self._max_maps:  # the rest are in use by views
                    return None
            if size == 0:
                return None
            try:
                region = mmap.mmap(entry.fd, 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):  # out of descriptors or map areas: read it instead
                return None
            entry.region = region
            self._regions.add(region)
            return memoryview(region)

    def _unmap_idle(self) -> None:
        # Lock held: unmap idle files (least recently used first, keeping their descriptors) until a
        # mapping slot is free; mappings that views still use free theirs when the views go.
        for entry in self._open.values():
            if len(self._regions) < self._max_maps:
                return
            if entry.users == 0:
                self._unmap(entry)

    def _region(self, file: str) -> mmap.mmap | None:
        with self._cond:
            entry = self._open.get(file)
            return None if entry is None else entry.region

    def prefetch(self, file: str, offset: int, length: int) -> None:
        """Map a byte range's pages in one call (reading any the page cache lacks in large requests)
        instead of one page fault at a time while copying; a range the file no longer holds raises
        :class:`TruncatedFileError` here instead of SIGBUS later."""
        self.prefetch_ranges(file, [(offset, length)])

    def prefetch_ranges(self, file: str, ranges: Sequence[tuple[int, int]]) -> None:
        """:meth:`prefetch` of several ``(offset, length)`` ranges: the kernel is told every range
        first (read exactly those pages, in parallel), then each is mapped — no read-around."""
        region = self._region(file)
        ranges = [(offset, length) for offset, length in ranges if length > 0]
        if region is None or not ranges:
            return
        self._advise(file, ranges)
        for offset, length in ranges:
            self._populate_range(file, region, offset, length)

    def advise(self, file: str, ranges: Sequence[tuple[int, int]]) -> None:
        """Ask the kernel to start reading ``(offset, length)`` ranges into the page cache and return
        at once (``posix_fadvise(WILLNEED)``): a read-ahead. Advisory: never raises for I/O."""
        self._advise(file, [(offset, length) for offset, length in ranges if length > 0])

    def resident_fraction(self, file: str, offset: int, length: int, max_pages: int | None = None) -> float | None:
        """The fraction of the pages of ``[offset, offset + length)`` of ``file`` in the page cache
        (``mincore``; no I/O; estimated from ``max_pages`` sampled pages if given); None when it
        cannot be known."""
        region = self._region(file)
        if region is not None and not region.closed:
            with contextlib.suppress(ValueError):  # unmapped meanwhile: probe a fresh mapping
                return resident_fraction(region, offset, length, max_pages)
        with self._use(file) as entry:
            try:
                with mmap.mmap(entry.fd, 0, access=mmap.ACCESS_READ) as probe:
                    return resident_fraction(probe, offset, length, max_pages)
            except (OSError, ValueError):  # an empty file, or out of map areas
                return None

    def _advise(self, file: str, ranges: Sequence[tuple[int, int]]) -> None:
        """``posix_fadvise(WILLNEED)`` on exactly ``ranges``, in pieces of at most ADVISE_CHUNK_BYTES.
        Advisory: a failure only loses the head start."""
        with self._use(file) as entry, contextlib.suppress(OSError):
            for offset, length in ranges:
                for at in range(offset, offset + length, ADVISE_CHUNK_BYTES):
                    piece = min(ADVISE_CHUNK_BYTES, offset + length - at)
                    os.posix_fadvise(entry.fd, at, piece, os.POSIX_FADV_WILLNEED)

    def _populate_range(self, file: str, region: mmap.mmap, offset: int, length: int) -> None:
        start = offset - offset % mmap.PAGESIZE
        try:
            if offset + length > len(region):
                raise TruncatedFileError(
                    file, f"needs bytes [{offset}, {offset + length}) beyond its {len(region)}-byte mapping"
                )
            with fetching(length):
                if self._populate:
                    try:
                        # Unlike touching the pages, a range beyond the end of the file is EFAULT, not SIGBUS.
                        madvise(region, start, offset + length - start, MADV_POPULATE_READ)
                        return
                    except OSError as e:
                        if e.errno != errno.EINVAL:
                            raise
                        self._populate = False  # kernels before 5.14: ask for readahead instead
                madvise(region, start, offset + length - start, mmap.MADV_WILLNEED)
        except ValueError as e:
            if region.closed:  # unmapped meanwhile (evicted; views keep their own): nothing to do
                return
            raise SourceError(f"{file}: cannot prefetch bytes [{offset}, {offset + length}): {e}") from e
        except OSError as e:  # EFAULT: the file was truncated under the mapping
            with self._use(file) as entry:
                self._check_covers(file, entry, offset, length)
            raise SourceError(f"{file}: cannot read bytes [{offset}, {offset + length}): {e.strerror}") from e

    def release(self, file: str, offset: int, length: int) -> None:
        """Drop the mapped pages of a byte range from this process (the page cache keeps them).

        Advisory: never raises, so that callers can use it while cleaning up after another error.
        """
        region = self._region(file)
        if region is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        with contextlib.suppress(ValueError, OSError):  # unmapped meanwhile (evicted), or beyond the mapping
            end = min(len(region), offset + length)
            if end > start:
                madvise(region, start, end - start, mmap.MADV_DONTNEED)

    # --- plain reads ------------------------------------------------------------------------------

    def size(self, file: str) -> int:
        with self._use(file) as entry:
            return os.fstat(entry.fd).st_size

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        self._advise(file, [(offset, len(out))])  # exactly these pages: no read-ahead past them
        self._read_into(file, offset, out)

    def _read_into(self, file: str, offset: int, out: memoryview) -> None:
        done, want = 0, len(out)
        with self._use(file) as entry, fetching(want):
            while done < want:
                try:
                    n = os.preadv(entry.fd, [out[done:]], offset + done)
                except OSError as e:
                    raise SourceError(f"{file}: cannot read bytes [{offset}, {offset + want}): {e.strerror}") from e
                if n == 0:
                    size = os.fstat(entry.fd).st_size
                    raise TruncatedFileError(
                        file, f"needs bytes [{offset}, {offset + want}) but the file has only {size} bytes"
                    )
                done += n

    # --- reads that bypass the page cache ---------------------------------------------------------

    direct_align = DIRECT_ALIGN

    def direct_capable(self, file: str) -> bool:
        """Whether ``file`` can be read with ``O_DIRECT`` (probed once: its file system may refuse)."""
        if file not in self._direct:
            try:
                os.close(self._open_direct(file))
                self._direct[file] = True
            except OSError:  # EINVAL: not on this file system (missing files fail in the plain reads)
                self._direct[file] = False
        return self._direct[file]

    def _open_direct(self, file: str) -> int:
        fd = os.open(self._path(file), os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        st = os.fstat(fd)
        if self._identity.setdefault(file, (st.st_dev, st.st_ino)) != (st.st_dev, st.st_ino):
            os.close(fd)
            raise CorruptFileError(file, "was replaced by another file (another inode) since it was first opened")
        return fd

    def read_direct_into(self, file: str, offset: int, out: memoryview) -> int:
        """Read ``[offset, offset + len(out))`` of ``file`` into ``out`` with ``O_DIRECT``; ``offset``,
        ``len(out)`` and ``out``'s address are multiples of :data:`DIRECT_ALIGN`. Returns the bytes
        read: fewer only where the file ends inside the range (the rest of ``out`` is left as is).
        One descriptor per call (opening costs microseconds beside a read of megabytes)."""
        fd, done = self._open_direct(file), 0
        try:
            while done < len(out):
                try:
                    n = os.preadv(fd, [out[done:]], offset + done)
                except OSError as e:
                    raise SourceError(f"{file}: cannot read bytes [{offset}, {offset + len(out)}): {e.strerror}") from e
                done += n
                if n == 0 or done % DIRECT_ALIGN:  # the file's end (a partial last block)
                    break
        finally:
            os.close(fd)
        with fetching(done):
            return done

    def read_many(self, reads: Sequence[RangeRead], gaps: GapPolicy = DEFAULT_GAPS) -> None:
        """Read each range (``gaps`` is not needed: every range is advised first, and the kernel
        reads pages, not requests)."""
        for r in reads:  # every range advised first: the kernel reads them while we copy
            self._advise(r.file, [(r.offset, len(r.out))])
        for r in reads:
            self._read_into(r.file, r.offset, r.out)

    def close(self) -> None:
        """Close every file and mapping; waits for reads in progress in other threads. A mapping that
        views still use is unmapped when the last of them goes. The source reopens files if used again."""
        with self._cond:
            while self._open:
                if not self._evict_one():
                    self._cond.wait()

    def __repr__(self) -> str:
        return f"LocalSource({str(self.root)!r})"
