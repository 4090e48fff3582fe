"""Test sources that record every range read, to prove a reader never reads past a file or into tensor data."""

from __future__ import annotations

from collections.abc import Sequence

from otfload.errors import SourceNotFoundError, TruncatedFileError
from otfload.sources.base import RangeRead, Source


class MemorySource:
    """An in-memory :class:`~otfload.sources.Source` over ``{name: bytes}``."""

    def __init__(self, files: dict[str, bytes]):
        self.files = files

    @property
    def description(self) -> str:
        return "memory"

    def list_files(self) -> list[str]:
        return sorted(self.files)

    def size(self, file: str) -> int:
        if file not in self.files:
            raise SourceNotFoundError(f"{file!r} not found")
        return len(self.files[file])

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        data = self.files[file][offset : offset + len(out)] if offset >= 0 else b""
        if len(data) != len(out):
            raise TruncatedFileError(file, f"wanted {len(out)} bytes at {offset}")
        out[:] = data

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        for r in reads:
            self.read_into(r.file, r.offset, r.out)

    def close(self) -> None:
        pass


class RecordingSource:
    """Wraps a source and records ``(file, offset, length)`` of every read, checked against the file size."""

    def __init__(self, inner: Source):
        self.inner = inner
        self.reads: list[tuple[str, int, int]] = []

    @property
    def description(self) -> str:
        return self.inner.description

    def list_files(self) -> list[str]:
        return self.inner.list_files()

    def size(self, file: str) -> int:
        return self.inner.size(file)

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        self.reads.append((file, offset, len(out)))
        self.inner.read_into(file, offset, out)

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        for r in reads:
            self.read_into(r.file, r.offset, r.out)

    def close(self) -> None:
        self.inner.close()

    def out_of_bounds(self) -> list[tuple[str, int, int]]:
        """Reads that started before 0 or ended past the end of their file."""
        return [(f, o, n) for f, o, n in self.reads if o < 0 or o + n > self.inner.size(f)]

    def read_files(self) -> set[str]:
        return {f for f, _, _ in self.reads}
