"""Test support: in-memory and recording sources, and the two parsers (ours, the reference) side by side.

The recording source proves a reader never reads past a file or into tensor data; ``reference_parse``
runs the ``safetensors`` package's own (Rust) parser on the same bytes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import safetensors

from otfload.errors import OtfloadError, SourceNotFoundError, TruncatedFileError
from otfload.index.dtypes import SAFETENSORS_DTYPES
from otfload.index.header import FileHeader, read_header
from otfload.sources.base import RangeRead, Source, read_bytes

FILE = "model.safetensors"


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


def otfload_parse(blob: bytes) -> tuple[FileHeader | OtfloadError, RecordingSource]:
    """Our parse of ``blob`` as a file, through a recording source; a typed error is returned, not raised."""
    source = RecordingSource(MemorySource({FILE: blob}))
    try:
        return read_header(source, FILE), source
    except OtfloadError as e:
        return e, source


def reference_parse(blob: bytes) -> dict[str, dict] | Exception:
    """``{name: {"dtype", "shape", "data"}}`` from the ``safetensors`` package, or the exception it raised."""
    try:
        return dict(safetensors.deserialize(blob))
    except Exception as e:  # noqa: BLE001 - any rejection by the reference counts as "rejected"
        return e


def assert_same_as_reference(header: FileHeader, reference: dict[str, dict], source: Source) -> None:
    """Same names, dtypes, shapes, and byte-identical data read through our offsets."""
    assert sorted(header.tensors) == sorted(reference)
    for name, info in header.tensors.items():
        ref = reference[name]
        assert (np.dtype(info.dtype), list(info.shape)) == (SAFETENSORS_DTYPES[ref["dtype"]], ref["shape"]), name
        assert read_bytes(source, info.file, info.offset, info.nbytes) == bytes(ref["data"]), name
