"""Where the shard cache keeps whole copies of checkpoint files: a directory or an fsspec URL.

A file becomes visible under its name only once complete: it is written under a hidden temporary
name next to it, then renamed. A directory: ``fsync``, ``os.replace``, ``fsync`` of the directory.
An object store: an upload to a temporary object, then a server-side copy to the final name —
objects appear atomically, so a reader never sees a partial file, and a writer killed midway
leaves at most a hidden ``.NAME.partial-*`` object. (gcsfs's ``"xb"`` mode, an
``ifGenerationMatch=0`` upload to the final name, would commit on close, before the file's sha256
is checked.) The sha256 a file was verified against is kept in ``NAME.sha256`` next to it, so a
later reuse need not hash the file again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

import fsspec

from otfload.sources.base import Source
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.local import LocalSource

PARTIAL_MARK = ".partial-"
SHA256_SUFFIX = ".sha256"
HASH_CHUNK_BYTES = 8 << 20


def _partial_name(name: str) -> str:
    """``dir/.base.partial-<random>``: hidden, unique per writer, never a checkpoint file name."""
    head, _, base = name.rpartition("/")
    return f"{head}/" * bool(head) + f".{base}{PARTIAL_MARK}{uuid.uuid4().hex}"


def _hash_stream(f: BinaryIO) -> str:
    digest = hashlib.sha256()
    while chunk := f.read(HASH_CHUNK_BYTES):
        digest.update(chunk)
    return digest.hexdigest()


class Store(Protocol):
    """Committed whole files under one root."""

    @property
    def description(self) -> str: ...

    def committed_size(self, name: str) -> int | None:
        """Size of the committed ``name``, or None if there is none."""
        ...

    def writer(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """A file to write ``name`` into; committed when the block exits cleanly, discarded otherwise."""
        ...

    def remove(self, name: str) -> None:
        """Delete the committed ``name`` and its recorded sha256, if any."""
        ...

    def sha256(self, name: str) -> str:
        """Hash the committed ``name``."""
        ...

    def source(self) -> Source:
        """A :class:`Source` reading the committed files by byte range."""
        ...

    def read_text(self, name: str) -> str | None:
        """The content of a small committed file, or None if it does not exist."""
        ...


def record_sha256(store: Store, name: str, sha256: str) -> None:
    with store.writer(name + SHA256_SUFFIX) as f:
        f.write(sha256.encode())


def recorded_sha256(store: Store, name: str) -> str | None:
    text = store.read_text(name + SHA256_SUFFIX)
    return text.strip() if text is not None else None


class LocalStore:
    """A directory, shared by every process that uses it (NFS, a shared volume, or one host's disk)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def description(self) -> str:
        return str(self.root)

    def committed_size(self, name: str) -> int | None:
        try:
            return (self.root / name).stat().st_size
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        final = self.root / name
        final.parent.mkdir(parents=True, exist_ok=True)
        partial = self.root / _partial_name(name)
        try:
            with open(partial, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(partial, final)
            _fsync_dir(final.parent)
        finally:
            partial.unlink(missing_ok=True)

    def remove(self, name: str) -> None:
        for path in (self.root / name, self.root / (name + SHA256_SUFFIX)):
            path.unlink(missing_ok=True)

    def sha256(self, name: str) -> str:
        with open(self.root / name, "rb") as f:
            return _hash_stream(f)

    def source(self) -> Source:
        return LocalSource(self.root)

    def read_text(self, name: str) -> str | None:
        try:
            return (self.root / name).read_text()
        except FileNotFoundError:
            return None


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable (a crash after it cannot bring back the old entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FsspecStore:
    """A prefix of an fsspec filesystem, e.g. ``gs://bucket/cache`` through gcsfs."""

    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.storage_options = storage_options
        self._fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self._root = root.rstrip("/")

    @property
    def description(self) -> str:
        return self._fs.unstrip_protocol(self._root)  # no credentials, unlike the URL

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def committed_size(self, name: str) -> int | None:
        self._fs.invalidate_cache(self._path(name))
        try:
            return int(self._fs.info(self._path(name))["size"])
        except FileNotFoundError:
            return None

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[BinaryIO]:
        partial = self._path(_partial_name(name))
        try:
            with self._fs.open(partial, "wb") as f:
                yield f
            self._fs.copy(partial, self._path(name))  # server-side; gcsfs's mv tries an API emulators lack
        finally:
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(partial)
            self._fs.invalidate_cache()

    def remove(self, name: str) -> None:
        for path in (self._path(name), self._path(name + SHA256_SUFFIX)):
            with contextlib.suppress(FileNotFoundError):
                self._fs.rm_file(path)

    def sha256(self, name: str) -> str:
        with self._fs.open(self._path(name), "rb") as f:
            return _hash_stream(f)

    def source(self) -> Source:
        self._fs.invalidate_cache()
        return FsspecSource(self.url, self.storage_options)

    def read_text(self, name: str) -> str | None:
        try:
            return self._fs.cat_file(self._path(name)).decode()
        except FileNotFoundError:
            return None


def open_store(location: str | os.PathLike, storage_options: dict | None = None) -> Store:
    """A :class:`FsspecStore` for ``scheme://`` URLs, else a :class:`LocalStore` for the directory."""
    text = os.fspath(location)
    return FsspecStore(text, storage_options) if "://" in text else LocalStore(text)
