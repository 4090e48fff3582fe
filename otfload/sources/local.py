"""A checkpoint in a local directory: memory-mapped read-only (zero-copy views), or read with ``os.preadv``.

Mapping lets the builder copy each byte once, straight from the page cache into its final buffer;
mapped pages count in the process's RSS until released, so callers release each range when done.
A file truncated by another process while it is mapped would fault on access: with ``mmap=False``
every read is a ``preadv`` (one more copy) that reports such a file as ``TruncatedFileError``.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from otfload.errors import SourceNotFoundError, TruncatedFileError
from otfload.sources.base import RangeRead

# Linux 5.14+: populate page tables for a range, reading pages in as needed (not in Python's mmap).
MADV_POPULATE_READ = 22


class LocalSource:
    """Files under a local directory; file descriptors are opened once and shared by threads."""

    def __init__(self, root: str | os.PathLike, *, mmap: bool = True):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise SourceNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
        self.use_mmap = mmap
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        return str(self.root)

    def list_files(self) -> list[str]:
        return sorted(
            str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file() and ".cache" not in p.parts
        )

    def _path(self, file: str) -> Path:
        path = (self.root / file).resolve()
        if self.root not in path.parents:
            raise SourceNotFoundError(f"{file!r} is outside the checkpoint directory {str(self.root)!r}")
        return path

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                try:
                    fd = os.open(self._path(file), os.O_RDONLY)
                except FileNotFoundError as e:
                    raise SourceNotFoundError(f"{file!r} not found in {str(self.root)!r}") from e
                self._fds[file] = fd
            return fd

    def mapped(self, file: str) -> mmap.mmap | None:
        """The whole file mapped read-only (shared by threads), or None when mapping is off."""
        if not self.use_mmap:
            return None
        fd = self._fd(file)
        with self._lock:
            if file not in self._maps:
                self._maps[file] = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            return self._maps[file]

    def prefetch(self, file: str, offset: int, length: int) -> None:
        """Map a byte range's pages in one call (reading any the page cache lacks in large requests)
        instead of one page fault at a time while copying."""
        region = self._maps.get(file)
        if region is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        try:
            region.madvise(MADV_POPULATE_READ, start, min(len(region), offset + length) - start)
        except OSError:  # kernels before 5.14: ask for readahead instead
            region.madvise(mmap.MADV_WILLNEED, start, min(len(region), offset + length) - start)

    def release(self, file: str, offset: int, length: int) -> None:
        """Drop the mapped pages of a byte range from this process (the page cache keeps them)."""
        region = self._maps.get(file)
        if region is None or length <= 0:
            return
        start = offset - offset % mmap.PAGESIZE
        region.madvise(mmap.MADV_DONTNEED, start, min(len(region), offset + length) - start)

    def size(self, file: str) -> int:
        return os.fstat(self._fd(file)).st_size

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        fd, done, want = self._fd(file), 0, len(out)
        while done < want:
            n = os.preadv(fd, [out[done:]], offset + done)
            if n == 0:
                raise TruncatedFileError(
                    file, f"wanted {want} bytes at offset {offset}, file ends after {offset + done}"
                )
            done += n

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        for r in reads:
            self.read_into(r.file, r.offset, r.out)

    def close(self) -> None:
        with self._lock:
            for region in self._maps.values():
                with contextlib.suppress(BufferError):  # a view is still alive; it closes with it
                    region.close()
            self._maps.clear()
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __repr__(self) -> str:
        return f"LocalSource({str(self.root)!r})"
