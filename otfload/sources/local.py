"""A checkpoint in a local directory, read with ``os.preadv`` (no mmap: no file pages in our RSS)."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from otfload.errors import SourceNotFoundError, TruncatedFileError
from otfload.sources.base import RangeRead


class LocalSource:
    """Files under a local directory; file descriptors are opened once and shared by threads."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        if not self.root.is_dir():
            raise SourceNotFoundError(f"checkpoint directory {str(root)!r} does not exist")
        self._fds: dict[str, int] = {}
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
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __repr__(self) -> str:
        return f"LocalSource({str(self.root)!r})"
