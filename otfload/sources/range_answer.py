"""Checking an HTTP answer to a ``Range`` request, so that no wrong byte is ever taken for a right one.

:func:`check_range_answer` reads the status, ``Content-Range``, ``Content-Length`` and
``Content-Encoding`` of an answer and says how to take the bytes asked for from its body (or raises
:class:`~otfload.errors.SourceProtocolError`); :class:`RangeSink` copies them out of the body as it
arrives and checks its length.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import NamedTuple

from otfload.errors import SourceProtocolError
from otfload.sources.retry import TransientError
from otfload.sources.runs import MAX_RUN_BYTES

# A server ignoring Range answers 200 with the whole file: discarding up to this many leading bytes
# (one MAX_RUN_BYTES run) is cheaper than failing; beyond it the read is refused, typed.
MAX_SKIP_BYTES = MAX_RUN_BYTES
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class RangeAnswer(NamedTuple):
    """How to take the bytes asked for from an HTTP answer's body."""

    skip: int  # body bytes before the first wanted one (a 200 with the whole file)
    take: int  # wanted bytes in the body (fewer than asked when a server sends a shorter range)
    body_size: int  # bytes the body must have
    may_stop: bool  # the rest of the body may be left unread once ``take`` bytes are in


def check_range_answer(
    status: int, headers: Mapping[str, str], what: str, start: int, last: int, size: int
) -> RangeAnswer:
    """Check an answer to ``Range: bytes=start-last`` on a file of ``size`` bytes; ``headers`` is
    case-insensitive. Raises :class:`SourceProtocolError` (naming ``what``) for anything that could
    deliver other bytes than those asked for."""
    encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise SourceProtocolError(
            f"{what}: answered a byte range with Content-Encoding {encoding!r}; identity was asked, "
            "encoded bytes cannot be sliced"
        )
    length_text = headers.get("Content-Length")
    length = None
    if length_text is not None:
        if not length_text.strip().isdigit():
            raise SourceProtocolError(f"{what}: Content-Length {length_text!r} is not a byte count")
        length = int(length_text)
    if status == 200:  # the Range header was ignored: the body is the whole file
        if length is not None and length != size:
            raise SourceProtocolError(f"{what}: answered a byte range with 200 and {length} bytes, the file has {size}")
        if start > MAX_SKIP_BYTES:
            raise SourceProtocolError(
                f"{what}: the server ignores Range requests (200 with the whole file for bytes {start}-{last})"
            )
        return RangeAnswer(start, last - start + 1, size, length is not None)
    if status != 206:
        raise SourceProtocolError(f"{what}: unexpected HTTP {status} for a byte range")
    header = headers.get("Content-Range")
    m = _CONTENT_RANGE.fullmatch((header or "").strip())
    if m is None:
        raise SourceProtocolError(f"{what}: 206 with Content-Range {header!r}, expected 'bytes {start}-{last}/{size}'")
    first, end, total = int(m[1]), int(m[2]), m[3]
    if total != "*" and int(total) != size:
        raise SourceProtocolError(f"{what}: Content-Range {header!r} says the file has {total} bytes, not {size}")
    if first != start or end < first or end > last:
        raise SourceProtocolError(f"{what}: asked for bytes {start}-{last}, Content-Range says {header!r}")
    if length is not None and length != end - first + 1:
        raise SourceProtocolError(f"{what}: Content-Length {length} does not match Content-Range {header!r}")
    return RangeAnswer(0, end - first + 1, end - first + 1, False)


class RangeSink:
    """Copies the wanted bytes of a checked answer's body, chunk by chunk, into ``out[done:]``."""

    def __init__(self, answer: RangeAnswer, out: memoryview, done: int, what: str):
        self.answer, self.out, self.done, self.what = answer, out, done, what
        self.seen = 0  # body bytes received

    def feed(self, chunk: bytes | memoryview) -> bool:
        """Take ``chunk``; True once the rest of the body may be left unread."""
        view, (skip, take, body_size, may_stop) = memoryview(chunk), self.answer
        lo, hi = max(skip, self.seen) - self.seen, min(skip + take, self.seen + len(view)) - self.seen
        if lo < hi:
            self.out[self.done : self.done + hi - lo] = view[lo:hi]
            self.done += hi - lo
        self.seen += len(view)
        if self.seen > body_size:
            raise SourceProtocolError(f"{self.what}: the body is longer than the {body_size} bytes announced")
        return may_stop and self.seen >= skip + take

    def drain(self, readinto: Callable[[memoryview], int], piece: int) -> None:
        """Read the body through ``readinto`` (0 at its end), ``piece`` bytes at most per call: the
        wanted bytes straight into ``out``, skipped and trailing ones into one scratch piece.
        Stops at the body's end, or once the wanted bytes are in when the rest may be left unread."""
        skip, take, body_size, may_stop = self.answer
        scratch: memoryview | None = None
        while not (may_stop and self.seen >= skip + take):
            if skip <= self.seen < skip + take:
                got = readinto(self.out[self.done : self.done + min(piece, skip + take - self.seen)])
                self.done += got
            else:  # before the wanted bytes (a 200's head), or after them: the rest, and one byte more is an error
                n = min(piece, skip - self.seen if self.seen < skip else body_size - self.seen + 1)
                scratch = scratch if scratch is not None and len(scratch) >= n else memoryview(bytearray(n))
                got = readinto(scratch[:n])
            if got == 0:
                return
            self.seen += got
            if self.seen > body_size:
                raise SourceProtocolError(f"{self.what}: the body is longer than the {body_size} bytes announced")

    def finish(self) -> None:
        """The body ended: a short one is worth a retry (what arrived is kept)."""
        if self.seen < self.answer.body_size and not (self.answer.may_stop and self.seen >= sum(self.answer[:2])):
            raise TransientError(f"response body ended after {self.seen} of {self.answer.body_size} bytes")
