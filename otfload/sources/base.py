"""The source protocol: where checkpoint bytes come from.

A source is a flat namespace of files (``config.json``, ``model-00001-of-00002.safetensors``, ...)
that can be listed, sized and read by byte range. Everything above this layer (index, plan, read)
sees only this protocol, so a local directory, a Hub repository and a bucket prefix behave alike.

Some sources can do more, and say so by the methods they have; each optional capability is a small
protocol here, checked with ``isinstance`` (which a type checker follows, unlike ``getattr``):

- :class:`MappedSource` — maps local files: reads are zero-copy page-cache views, announced before
  they are touched and released after (:class:`~otfload.sources.local.LocalSource`);
- :class:`RangePrefetchingSource` — announces several ranges of a file in one call;
- :class:`PageGranularSource` — says whether its files are read in whole pages (local files);
- :class:`DownloadableSource` — keeps whole-file copies itself (the Hub's cache);
- :class:`HashedSource` / :class:`DigestSource` — publishes a file's sha256 / other checksums;
- :class:`PinnedSource` — is pinned to a commit (a Hub revision), part of a shard cache's key;
- :class:`GapReadingSource` — its ``read_many`` takes the caller's gap rule (``gaps=``, a
  :class:`~otfload.accounting.gaps.GapPolicy`): every built-in source. A keyword is not a method
  ``isinstance`` can see, so :func:`read_many` checks the signature, and calls a source written to
  the protocol without it (a user's) with ``reads`` alone.

Who closes a source is decided in one place: :mod:`otfload.sources.owned`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from typing import NamedTuple, Protocol, TypeGuard, runtime_checkable

from otfload.accounting.gaps import DEFAULT_GAPS, GapPolicy

# Largest file size believed from a listing or metadata (Hub, fsspec): 16 TiB, far above any
# safetensors shard; a larger (or a negative) one is a broken server, and planning must not
# allocate or seek by it.
MAX_FILE_BYTES = 1 << 44


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
        """Perform several range reads, possibly in parallel (a :class:`GapReadingSource` also takes
        the gap rule its batch is coalesced under)."""
        ...

    def close(self) -> None:
        """Release open handles."""
        ...


@runtime_checkable
class MappedSource(Protocol):
    """A source that maps its files: :meth:`mapped` gives a read-only view of the page cache."""

    @property
    def use_mmap(self) -> bool:
        """Whether reads go through mappings (a local source opened with ``mmap=False`` has none)."""
        ...

    def mapped(self, file: str, offset: int = 0, length: int = 0) -> memoryview | None:
        """A view of the whole of ``file`` once ``offset + length`` bytes are checked present; None if
        this file is not mapped."""
        ...

    def prefetch(self, file: str, offset: int, length: int) -> None:
        """Announce that ``length`` bytes from ``offset`` are about to be read (read-ahead)."""
        ...

    def release(self, file: str, offset: int, length: int) -> None:
        """Done with the range: its pages may leave this process's memory."""
        ...


@runtime_checkable
class RangePrefetchingSource(Protocol):
    """A source that announces several ``(offset, length)`` ranges of one file in one call."""

    def prefetch_ranges(self, file: str, ranges: Sequence[tuple[int, int]]) -> None: ...


@runtime_checkable
class PageGranularSource(Protocol):
    """A source that says whether its files are read in whole pages (local files: the kernel's unit)."""

    @property
    def page_granular(self) -> bool: ...


@runtime_checkable
class DirectSource(Protocol):
    """A source of local files that can read them bypassing the page cache (``O_DIRECT``): offsets,
    lengths and buffer addresses multiples of ``direct_align``."""

    direct_align: int

    def direct_capable(self, file: str) -> bool: ...

    def read_direct_into(self, file: str, offset: int, out: memoryview) -> int: ...


@runtime_checkable
class ResidencySource(Protocol):
    """A source of local files that can say how much of a range is in the page cache and ask the
    kernel to read a range ahead (what a cold-cache read-ahead needs)."""

    def advise(self, file: str, ranges: Sequence[tuple[int, int]]) -> None: ...

    def resident_fraction(self, file: str, offset: int, length: int, max_pages: int | None = None) -> float | None: ...


@runtime_checkable
class DownloadableSource(Protocol):
    """A source that keeps complete local copies of its files (the Hub's own cache)."""

    def download(self, file: str) -> str:
        """The path of a complete, checked local copy of ``file``, fetched if needed."""
        ...


@runtime_checkable
class HashedSource(Protocol):
    """A source that publishes the sha256 of (some of) its files."""

    def sha256(self, file: str) -> str | None: ...


@runtime_checkable
class DigestSource(Protocol):
    """A source that publishes other checksums of its files (``{"md5": ..., "crc32c": ...}``)."""

    def digests(self, file: str) -> dict[str, str]: ...


@runtime_checkable
class PinnedSource(Protocol):
    """A source pinned to one commit of a versioned store (a Hub revision resolved when opened)."""

    @property
    def commit(self) -> str | None: ...


class GapReadingSource(Protocol):
    """A source whose ``read_many`` takes ``gaps``: how many bytes between the ranges asked it may
    read to save requests (:func:`~otfload.accounting.gaps.joined_gaps`' budget). The default,
    :data:`~otfload.accounting.gaps.DEFAULT_GAPS`, is the rule for a batch nobody planned; a reader that
    planned its pieces passes :data:`~otfload.accounting.gaps.PLANNED_GAPS`, the rule its plan predicted
    the requests with. Sources that read no gaps (local files) take it and ignore it; wrappers pass
    it on."""

    def read_many(self, reads: Sequence[RangeRead], gaps: GapPolicy = DEFAULT_GAPS) -> None: ...


@functools.cache
def _takes_gaps(cls: type[Source]) -> bool:
    try:
        return "gaps" in inspect.signature(cls.read_many).parameters
    except (AttributeError, TypeError, ValueError):  # no read_many on the class, or no signature to read
        return False


def takes_gaps(source: Source) -> TypeGuard[GapReadingSource]:
    """Whether ``source``'s ``read_many`` takes a ``gaps`` keyword (its class's signature, read once)."""
    return _takes_gaps(type(source))


def read_many(source: Source, reads: Sequence[RangeRead], gaps: GapPolicy) -> None:
    """``source.read_many(reads)`` coalesced under ``gaps`` where the source takes the rule
    (:class:`GapReadingSource`); a source written without it reads ``reads`` its own way."""
    if takes_gaps(source):
        source.read_many(reads, gaps=gaps)
    else:
        source.read_many(reads)


def read_bytes(source: Source, file: str, offset: int = 0, length: int | None = None) -> bytes:
    """Read a byte range (the whole file when ``length`` is None) as ``bytes``."""
    if length is None:
        length = source.size(file) - offset
    buf = bytearray(length)
    source.read_into(file, offset, memoryview(buf))
    return bytes(buf)
