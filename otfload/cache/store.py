"""Where the shard cache keeps whole copies of checkpoint files: a directory or an fsspec URL.

Every name is checked (:func:`check_cache_name`) before a store touches it, so no name from a
source can point outside the cache root or at the cache's own files.

A file becomes visible under its name only once complete: it is written under a hidden temporary
name next to it, then renamed. A directory: ``fsync``, ``os.replace``, ``fsync`` of the directory;
every path inside the root is walked one folder at a time with ``O_NOFOLLOW``, so a symlink planted
in the cache (an entry or a folder) is never followed for a write or trusted for a read: it is a
:class:`~otfload.errors.CacheUnsafeNameError` naming it. An object store: an upload to a temporary
object, then a server-side copy to the final name — objects appear atomically, so a reader never
sees a partial file. (gcsfs's ``"xb"`` mode, an ``ifGenerationMatch=0`` upload to the final name,
would commit on close, before the file's digests are checked.)

A temporary is named ``.NAME.partial-<host>-<pid>-<random>``. One left by a killed writer is removed
by the next fill of any process on the same host once that pid is gone, and by any process once it
has not changed for :data:`ORPHAN_IDLE_S`. A cache location that is read-only, full, or a file is a
:class:`CacheStorageError` naming the path, never a raw ``OSError``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import socket
import stat
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from otfload.errors import CacheError, CacheStorageError, CacheUnsafeNameError
from otfload.sources.base import Source
from otfload.sources.fsspec_source import FsspecSource, open_filesystem
from otfload.sources.local import LocalSource
from otfload.sources.names import check_member_name

PARTIAL_MARK = ".partial-"
RECORD_SUFFIX = ".sha256"  # the record of NAME is NAME.sha256 (JSON; see otfload.cache.integrity)
# A temporary untouched this long belongs to a dead writer: a live one writes every window (256 MiB)
# and a stalled source read gives up within minutes (the retry deadline); peers waiting on a file
# give up after the fill timeout (30 min by default).
ORPHAN_IDLE_S = 3600.0
# Stamp fields of an object store's ``info``: any of them changes when an object is rewritten.
_OBJECT_STAMP_KEYS = ("generation", "md5Hash", "crc32c", "etag", "ETag", "LastModified", "mtime", "created")
_PARTIAL = re.compile(r"\.(?P<base>.+)\.partial-(?:(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-)?[0-9a-f]{12,32}")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_ONLY = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_IN_THE_WAY = frozenset({errno.ENOTDIR, errno.EEXIST, errno.EISDIR})


def storage_error(error: OSError, path: str, action: str, done: int | None = None) -> CacheError:
    """The typed error for an ``OSError`` met while doing ``action`` ("write", "read", ...) at ``path``
    (after writing ``done`` bytes of it, when given)."""
    code = error.errno
    if code == errno.ELOOP:
        return CacheUnsafeNameError(f"shard cache: {path} is a symbolic link; otfload never follows links "
                                    "inside the cache (remove it)")  # fmt: skip
    if code in _FULL:
        why = "the file system is full (no space left, quota or file-size limit reached)"
    elif code in _READ_ONLY:
        why = f"it is read-only or not {'writable' if action != 'read' else 'readable'} by this process"
    elif code in _IN_THE_WAY:
        why = "a file stands where a folder should be, or a folder where a file should be"
    else:
        why = error.strerror or str(error)
    name = errno.errorcode.get(code, "") if code is not None else ""
    after = f" after {done} bytes" if done is not None else ""
    return CacheStorageError(
        f"shard cache: cannot {action} {path}{after}: {why}" + f" ({name})" * bool(name), path, code
    )


def check_cache_name(name: object, where: str) -> str:
    """``name`` when it may name a cache entry: a safe member name (see :mod:`otfload.sources.names`)
    none of whose segments is reserved for the cache's own files (temporaries and records)."""
    name = check_member_name(name, where, CacheUnsafeNameError, "file name")
    for segment in name.split("/"):
        if segment.endswith(RECORD_SUFFIX) or (segment.startswith(".") and PARTIAL_MARK in segment):
            raise CacheUnsafeNameError(
                f"{where}: file name {name!r} uses a name reserved for the shard cache's own files "
                f"('{RECORD_SUFFIX}' records, '.{PARTIAL_MARK}' temporaries)"
            )
    return name


def _host_tag() -> str:
    """Who runs this process, as far as pids mean anything: host, boot and pid namespace."""
    parts = [socket.gethostname()]
    with contextlib.suppress(OSError):
        parts.append(Path("/proc/sys/kernel/random/boot_id").read_text().strip())
    with contextlib.suppress(OSError):
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:8]


HOST_TAG = _host_tag()


def partial_name(base: str) -> str:
    """``.base.partial-<host>-<pid>-<random>``: hidden, unique per writer, and saying whose it is."""
    return f".{base}{PARTIAL_MARK}{HOST_TAG}-{os.getpid()}-{uuid.uuid4().hex[:12]}"


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    try:  # a killed process nobody has reaped yet is a zombie: dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def is_orphan(base: str, idle_s: float | None) -> bool:
    """Whether ``base`` is a temporary whose writer is gone: a dead pid on this host, or idle too long."""
    m = _PARTIAL.fullmatch(base)
    if m is None:
        return False
    if m["host"] == HOST_TAG and not _pid_alive(int(m["pid"])):
        return True
    return idle_s is not None and idle_s > ORPHAN_IDLE_S


@dataclass(frozen=True)
class EntryStat:
    """A committed entry: its size, and the stamp its store changes whenever its bytes may change."""

    size: int
    stamp: dict[str, str]


class Sink(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> int: ...


class Store(Protocol):
    """Committed whole files under one root; every method checks the name it is given."""

    @property
    def description(self) -> str: ...

    def path(self, name: str) -> str:
        """Where ``name`` is, for messages."""
        ...

    def stat(self, name: str) -> EntryStat | None:
        """The committed ``name``, or None if there is none."""
        ...

    def writer(self, name: str) -> contextlib.AbstractContextManager[Sink]:
        """A sink to write ``name`` into; committed when the block exits cleanly, discarded otherwise."""
        ...

    def reader(self, name: str) -> contextlib.AbstractContextManager[BinaryIO]:
        """The committed ``name``, opened for reading."""
        ...

    def read_record(self, name: str) -> str | None:
        """The record of ``name``, or None if there is none."""
        ...

    def write_record(self, name: str, text: str) -> None: ...

    def remove(self, name: str) -> None:
        """Delete the committed ``name`` and its record, if any."""
        ...

    def clean_orphans(self) -> list[str]:
        """Delete the temporaries of dead writers (see :func:`is_orphan`); the paths deleted. Best effort."""
        ...

    def source(self) -> Source:
        """A :class:`Source` reading the committed files by byte range."""
        ...


class _FdSink:
    """Writes every byte to a file descriptor (looping over short writes); OSErrors typed."""

    def __init__(self, fd: int, path: str):
        self.fd, self.path, self.written = fd, path, 0

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view, done = memoryview(data).cast("B"), 0
        while done < len(view):
            try:
                done += os.write(self.fd, view[done:])
            except OSError as e:
                raise storage_error(e, self.path, "write", self.written + done) from None
        self.written += done
        return done


class LocalStore:
    """A folder ``key`` in the directory ``base``, shared by every process that uses it (NFS, a shared
    volume, or one host's disk). ``base`` is the user's choice and may be a symlink; nothing below it is."""

    def __init__(self, base: str | os.PathLike[str], key: str):
        self.key = check_cache_name(key, "shard cache key")
        if "/" in key:
            raise CacheUnsafeNameError(f"shard cache key {key!r} is not a single folder name")
        requested = Path(base).expanduser()
        try:
            requested.mkdir(parents=True, exist_ok=True)
            self.base = requested.resolve(strict=True)
        except OSError as e:
            raise storage_error(e, str(requested), "create the cache directory") from None
        self.root = self.base / key
        with self._folder(None, create=True):
            pass

    @property
    def description(self) -> str:
        return str(self.root)

    def path(self, name: str) -> str:
        return str(self.root / check_cache_name(name, self.description))

    # --- walking without following links ----------------------------------------------------------

    @contextlib.contextmanager
    def _folder(self, name: str | None, create: bool) -> Iterator[tuple[int, str] | None]:
        """``(fd of the folder holding name, its last segment)``, each folder opened with
        ``O_NOFOLLOW`` (and made when ``create``); None when a folder is missing. ``name`` None: the root."""
        name = None if name is None else check_cache_name(name, self.description)
        parts = [self.key, *(name.split("/") if name else [])]
        try:
            current = os.open(self.base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise storage_error(e, str(self.base), "open") from None
        fd: int | None = current  # what the finally closes
        try:
            for depth, part in enumerate(parts if name is None else parts[:-1]):
                shown = str(self.base.joinpath(*parts[: depth + 1]))
                child = self._open_folder(current, part, create, shown)
                os.close(current)
                fd = child
                if child is None:
                    yield None
                    return
                current = child
            yield (current, parts[-1]) if name is not None else (current, "")
        finally:
            if fd is not None:
                os.close(fd)

    @staticmethod
    def _open_folder(fd: int, part: str, create: bool, shown: str) -> int | None:
        if create:
            try:
                os.mkdir(part, dir_fd=fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise storage_error(e, shown, "create") from None
        try:
            return os.open(part, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            if create:
                raise storage_error(FileNotFoundError(errno.ENOENT, "vanished"), shown, "create") from None
            return None
        except OSError as e:
            error = e
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                    error = OSError(errno.ELOOP, "symbolic link")
            raise storage_error(error, shown, "open") from None

    def _lstat(self, fd: int, leaf: str, shown: str) -> os.stat_result | None:
        try:
            st = os.stat(leaf, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise storage_error(e, shown, "read") from None
        if stat.S_ISLNK(st.st_mode):
            raise storage_error(OSError(errno.ELOOP, "symbolic link"), shown, "read")
        if not stat.S_ISREG(st.st_mode):
            raise storage_error(OSError(errno.EISDIR, "not a file"), shown, "read")
        return st

    # --- the Store protocol ----------------------------------------------------------------------

    def stat(self, name: str) -> EntryStat | None:
        with self._folder(name, create=False) as where:
            if where is None:
                return None
            st = self._lstat(*where, self.path(name))
            if st is None:
                return None
            return EntryStat(st.st_size, {"mtime_ns": str(st.st_mtime_ns), "ctime_ns": str(st.st_ctime_ns)})

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[Sink]:
        with self._folder(name, create=True) as where:
            assert where is not None
            with self._atomic(*where, self.path(name)) as sink:
                yield sink

    @contextlib.contextmanager
    def _atomic(self, fd: int, leaf: str, shown: str) -> Iterator[_FdSink]:
        """Write ``leaf`` of the folder ``fd`` under a temporary name; rename it in place on success."""
        partial = partial_name(leaf)
        try:
            out = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                          dir_fd=fd)  # fmt: skip
        except OSError as e:
            raise storage_error(e, shown, "write") from None
        written = committed = False
        try:
            try:
                yield _FdSink(out, shown)
                written = True
                os.fsync(out)
            finally:
                os.close(out)
            os.replace(partial, leaf, src_dir_fd=fd, dst_dir_fd=fd)  # replaces a link itself, never its target
            committed = True
            os.fsync(fd)  # the rename is durable: a crash cannot bring back the old entry
        except OSError as e:
            if not written:  # the caller's own error, raised inside the block
                raise
            raise storage_error(e, shown, "commit" if committed else "write") from None
        finally:
            if not committed:
                with contextlib.suppress(OSError):
                    os.unlink(partial, dir_fd=fd)

    @contextlib.contextmanager
    def reader(self, name: str) -> Iterator[BinaryIO]:
        with self._folder(name, create=False) as where:
            if where is None:
                raise storage_error(FileNotFoundError(errno.ENOENT, "missing"), self.path(name), "read")
            fd, leaf = where
            try:
                f = os.fdopen(os.open(leaf, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd), "rb")
            except OSError as e:
                raise storage_error(e, self.path(name), "read") from None
            with f:
                yield f

    def read_record(self, name: str) -> str | None:
        with self._folder(name, create=False) as where:
            if where is None:
                return None
            fd, leaf = where
            shown = self.path(name) + RECORD_SUFFIX
            if self._lstat(fd, leaf + RECORD_SUFFIX, shown) is None:
                return None
            try:
                with os.fdopen(os.open(leaf + RECORD_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC,
                                       dir_fd=fd), "rb") as f:  # fmt: skip
                    return f.read(1 << 20).decode("utf-8", errors="replace")
            except FileNotFoundError:
                return None
            except OSError as e:
                raise storage_error(e, shown, "read") from None

    def write_record(self, name: str, text: str) -> None:
        with self._folder(name, create=True) as where:
            assert where is not None
            fd, leaf = where
            with self._atomic(fd, leaf + RECORD_SUFFIX, self.path(name) + RECORD_SUFFIX) as sink:
                sink.write(text.encode())

    def remove(self, name: str) -> None:
        with self._folder(name, create=False) as where:
            if where is None:
                return
            fd, leaf = where
            for target in (leaf, leaf + RECORD_SUFFIX):
                try:
                    os.unlink(target, dir_fd=fd)  # a link is removed itself, never its target
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise storage_error(e, self.path(name), "remove") from None

    def clean_orphans(self) -> list[str]:
        removed: list[str] = []
        now = time.time()
        with contextlib.suppress(OSError):
            for folder, _, files, fd in os.fwalk(self.root, follow_symlinks=False):
                for base in files:
                    if _PARTIAL.fullmatch(base) is None:
                        continue
                    with contextlib.suppress(OSError):
                        st = os.stat(base, dir_fd=fd, follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and is_orphan(base, now - st.st_mtime):
                            os.unlink(base, dir_fd=fd)
                            removed.append(os.path.join(folder, base))
        return removed

    def source(self) -> Source:
        with self._folder(None, create=False):  # the root is still a real folder, not a link
            pass
        return LocalSource(self.root)


class FsspecStore:
    """A prefix of an fsspec filesystem, e.g. ``gs://bucket/cache`` through gcsfs."""

    def __init__(self, base_url: str, key: str, storage_options: dict[str, Any] | None = None):
        self.key = check_cache_name(key, "shard cache key")
        self.url = f"{base_url.rstrip('/')}/{key}"
        self.storage_options = storage_options
        self._fs, root = open_filesystem(self.url, **(storage_options or {}))
        self._root = root.rstrip("/")

    @property
    def description(self) -> str:
        url: str = self._fs.unstrip_protocol(self._root)  # no credentials, unlike the URL
        return url

    def _path(self, name: str) -> str:
        return f"{self._root}/{check_cache_name(name, self.description)}"

    def path(self, name: str) -> str:
        url: str = self._fs.unstrip_protocol(self._path(name))
        return url

    def stat(self, name: str) -> EntryStat | None:
        path = self._path(name)
        self._fs.invalidate_cache(path)
        try:
            info = self._fs.info(path)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise storage_error(e, self.path(name), "read") from None
        if info.get("type") != "file":
            raise storage_error(OSError(errno.EISDIR, "not a file"), self.path(name), "read")
        stamp = {k: str(info[k]) for k in _OBJECT_STAMP_KEYS if info.get(k) is not None}
        return EntryStat(int(info["size"]), stamp)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[Sink]:
        final = self._path(name)
        head, _, base = final.rpartition("/")
        partial = f"{head}/{partial_name(base)}"
        written = False
        try:
            try:
                with self._fs.open(partial, "wb") as f:
                    yield _ObjectSink(f, self.path(name))
                    written = True
                self._fs.copy(partial, final)  # server-side; gcsfs's mv tries an API emulators lack
            except OSError as e:
                if not written:  # the caller's own error, raised inside the block
                    raise
                raise storage_error(e, self.path(name), "write") from None
        finally:
            with contextlib.suppress(OSError):
                self._fs.rm_file(partial)
            self._fs.invalidate_cache()

    @contextlib.contextmanager
    def reader(self, name: str) -> Iterator[BinaryIO]:
        try:
            f = self._fs.open(self._path(name), "rb")
        except OSError as e:
            raise storage_error(e, self.path(name), "read") from None
        with f:
            yield f

    def read_record(self, name: str) -> str | None:
        try:
            data = self._fs.cat_file(self._path(name) + RECORD_SUFFIX)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise storage_error(e, self.path(name) + RECORD_SUFFIX, "read") from None
        text: str = data.decode("utf-8", errors="replace")
        return text

    def write_record(self, name: str, text: str) -> None:
        try:
            self._fs.pipe_file(self._path(name) + RECORD_SUFFIX, text.encode())  # one upload: atomic
        except OSError as e:
            raise storage_error(e, self.path(name) + RECORD_SUFFIX, "write") from None

    def remove(self, name: str) -> None:
        for path in (self._path(name), self._path(name) + RECORD_SUFFIX):
            try:
                self._fs.rm_file(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise storage_error(e, self._fs.unstrip_protocol(path), "remove") from None

    def clean_orphans(self) -> list[str]:
        removed: list[str] = []
        now = time.time()
        try:
            self._fs.invalidate_cache(self._root)
            found = self._fs.find(self._root, detail=True)
        except OSError:
            return removed
        for path, info in found.items():
            base = path.rpartition("/")[2]
            if _PARTIAL.fullmatch(base) is None:
                continue
            changed = info.get("mtime") or info.get("created")  # a datetime (gcsfs) or a POSIX time
            idle = None
            if hasattr(changed, "timestamp"):
                idle = now - changed.timestamp()
            elif isinstance(changed, int | float):
                idle = now - changed
            if is_orphan(base, idle):
                with contextlib.suppress(OSError):
                    self._fs.rm_file(path)
                    removed.append(self._fs.unstrip_protocol(path))
        return removed

    def source(self) -> Source:
        self._fs.invalidate_cache()
        return FsspecSource(self.url, self.storage_options)


class _ObjectSink:
    def __init__(self, f: BinaryIO, path: str):
        self.f, self.path = f, path

    def write(self, data: bytes | bytearray | memoryview) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            raise storage_error(e, self.path, "write") from None


def open_store(cache_dir: str | os.PathLike[str], key: str, storage_options: dict[str, Any] | None = None) -> Store:
    """The folder ``key`` of ``cache_dir``: a :class:`FsspecStore` for ``scheme://`` URLs (a
    :class:`LocalStore` for ``file://``), else a :class:`LocalStore`."""
    text = os.fspath(cache_dir)
    if text.startswith("file://"):
        return LocalStore(text.removeprefix("file://"), key)
    return FsspecStore(text, key, storage_options) if "://" in text else LocalStore(text, key)
