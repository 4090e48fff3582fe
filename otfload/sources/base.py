"""The source protocol: where checkpoint bytes come from.

A source is a flat namespace of files (``config.json``, ``model-00001-of-00002.safetensors``, ...)
that can be listed, sized and read by byte range. Everything above this layer (index, plan, read)
sees only this protocol, so a local directory, a Hub repository and a bucket prefix behave alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol, runtime_checkable


class RangeRead(NamedTuple):
    """Read ``len(out)`` bytes of ``file`` starting at ``offset`` into the writable buffer ``out``."""

    file: str
    offset: int
    out: memoryview


@runtime_checkable
class Source(Protocol):
    """A checkpoint location readable by byte ranges."""

    @property
    def description(self) -> str:
        """A human-readable name for messages (never contains credentials)."""
        ...

    def list_files(self) -> list[str]:
        """Relative names of every file in the checkpoint (no directories)."""
        ...

    def size(self, file: str) -> int:
        """Length of ``file`` in bytes; raises ``SourceNotFoundError`` if it does not exist."""
        ...

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` with the bytes of ``file`` from ``offset``; short files raise ``TruncatedFileError``."""
        ...

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        """Perform several range reads, possibly in parallel."""
        ...

    def close(self) -> None:
        """Release open handles."""
        ...


def read_bytes(source: Source, file: str, offset: int = 0, length: int | None = None) -> bytes:
    """Read a byte range (the whole file when ``length`` is None) as ``bytes``."""
    if length is None:
        length = source.size(file) - offset
    buf = bytearray(length)
    source.read_into(file, offset, memoryview(buf))
    return bytes(buf)
