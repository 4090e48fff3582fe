"""What the shard cache knows about a file's bytes: the digests a source publishes, the streaming
hash computed while a file is fetched, and the record kept next to each committed copy.

A record (``NAME.sha256``, JSON) holds the size and sha256 of the bytes as they were committed, the
source revision and the digests the source published for them, and the entry's *stamp*: what its
store changes whenever the bytes may have changed (a file's ``mtime``/``ctime`` in nanoseconds, an
object's generation and checksums). A copy is reused only when its record still describes the
source's file; with ``verify="record"`` an unchanged stamp is trusted and any other stamp makes the
cache hash the copy again; with ``verify="full"`` every copy is hashed again on every use.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Container, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeGuard

from otfload.sources.base import DigestSource, HashedSource, Source

VERIFY_RECORD = "record"  # size + record + unchanged stamp (re-hash only when the stamp moved)
VERIFY_FULL = "full"  # re-hash every reused copy
VERIFY_MODES = (VERIFY_RECORD, VERIFY_FULL)
RECORD_FORMAT = 1
# A record is a few hundred bytes; a larger file at its name is not one of ours.
MAX_RECORD_BYTES = 64 << 10
# The digests a source may publish, in the encodings sources use: sha256 as hex (the Hub's LFS oid),
# md5 and crc32c as base64 of the big-endian digest (GCS's ``md5Hash`` and ``crc32c``).
KNOWN_ALGORITHMS = ("sha256", "md5", "crc32c")
# google_crc32c hashes ``bytes`` only; a fill window is copied in slices this big, not all at once.
CRC32C_SLICE_BYTES = 4 << 20

try:  # a dependency of gcsfs; without it crc32c is not checked (md5 and sha256 still are)
    import google_crc32c
except ImportError:  # pragma: no cover - depends on the environment
    google_crc32c = None  # type: ignore[assignment]  # checked for None before each use


def published_digests(source: Source, file: str) -> dict[str, str]:
    """The digests ``source`` publishes for ``file``: ``source.digests(file)`` (a mapping of
    ``"sha256"``/``"md5"``/``"crc32c"`` to values) of a :class:`DigestSource`, and
    ``source.sha256(file)`` of a :class:`HashedSource`."""
    out: dict[str, str] = {}
    if isinstance(source, DigestSource):
        out.update({k: str(v) for k, v in (source.digests(file) or {}).items() if k in KNOWN_ALGORITHMS and v})
    if "sha256" not in out and isinstance(source, HashedSource) and (value := source.sha256(file)):
        out["sha256"] = str(value)
    if "sha256" in out:
        out["sha256"] = out["sha256"].lower()
    if google_crc32c is None:
        out.pop("crc32c", None)
    return out


class _Crc32cHash(Protocol):
    """What Hasher uses of ``google_crc32c.Checksum`` (whose methods are unannotated)."""

    def update(self, chunk: bytes) -> None: ...

    def digest(self) -> bytes: ...


class Hasher:
    """sha256 of everything fed to it, plus md5 / crc32c when they are asked for."""

    def __init__(self, algorithms: Container[str] = ()):
        self._sha256 = hashlib.sha256()
        self._md5 = hashlib.md5(usedforsecurity=False) if "md5" in algorithms else None
        self._crc32c: _Crc32cHash | None = None
        if google_crc32c is not None and "crc32c" in algorithms:
            self._crc32c = google_crc32c.Checksum()  # type: ignore[no-untyped-call]  # unannotated __init__

    def update(self, data: bytes | bytearray | memoryview) -> None:
        self._sha256.update(data)
        if self._md5 is not None:
            self._md5.update(data)
        if self._crc32c is not None:  # its C extension takes only bytes: copy a slice at a time
            view = memoryview(data).cast("B")
            for start in range(0, len(view), CRC32C_SLICE_BYTES):
                self._crc32c.update(bytes(view[start : start + CRC32C_SLICE_BYTES]))

    def digests(self) -> dict[str, str]:
        out = {"sha256": self._sha256.hexdigest()}
        if self._md5 is not None:
            out["md5"] = base64.b64encode(self._md5.digest()).decode()
        if self._crc32c is not None:
            out["crc32c"] = base64.b64encode(self._crc32c.digest()).decode()
        return out


def mismatches(found: Mapping[str, str], expected: Mapping[str, str]) -> list[str]:
    """``"algo: found X, expected Y"`` for every algorithm both know and disagree on."""
    return [f"{a} {found[a]}, expected {expected[a]}" for a in KNOWN_ALGORITHMS
            if a in found and a in expected and found[a] != expected[a]]  # fmt: skip


@dataclass(frozen=True)
class Record:
    """What was committed for one cache entry; see the module docstring."""

    size: int
    sha256: str
    revision: str | None
    published: dict[str, str] = field(default_factory=dict)
    stamp: dict[str, str] = field(default_factory=dict)

    def dumps(self) -> str:
        return json.dumps({"format": RECORD_FORMAT, "size": self.size, "sha256": self.sha256,
                           "revision": self.revision, "published": self.published, "stamp": self.stamp},
                          sort_keys=True)  # fmt: skip

    @classmethod
    def loads(cls, text: str | None) -> Record | None:
        """The record in ``text``; None for no text, a damaged record or an older format."""
        if text is None or len(text) > MAX_RECORD_BYTES:
            return None
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict) or data.get("format") != RECORD_FORMAT:
            return None
        size, sha256, revision = data.get("size"), data.get("sha256"), data.get("revision")
        published, stamp = data.get("published"), data.get("stamp")
        if not (
            isinstance(size, int)
            and size >= 0
            and isinstance(sha256, str)
            and len(sha256) == 64
            and (revision is None or isinstance(revision, str))
            and _str_map(published)
            and _str_map(stamp)
        ):
            return None  # fmt: skip
        return cls(size, sha256, revision, dict(published), dict(stamp))

    def describes(self, size: int, revision: str | None, published: Mapping[str, str]) -> bool:
        """Whether this record is of the source's current file: same size, revision and published
        digests (every one the source publishes now must be in the record, and equal)."""
        if self.size != size or self.revision != revision:
            return False
        recorded = {**self.published, "sha256": self.sha256}
        return all(recorded.get(algo) == value for algo, value in published.items())


def _str_map(value: object) -> TypeGuard[dict[str, str]]:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


__all__ = ["VERIFY_FULL", "VERIFY_MODES", "VERIFY_RECORD", "Hasher", "Record", "mismatches", "published_digests"]
