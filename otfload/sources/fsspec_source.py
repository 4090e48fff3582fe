"""A checkpoint under any fsspec URL (``gs://``, ``s3://``, ``hf://``, ``memory://``, ``file://``).

Files are listed once when the source opens; tensors are read as byte ranges (``cat_file`` with
start/end), several in parallel, each under the shared retry policy.
"""

from __future__ import annotations

import os

# gcsfs 2026.x otherwise makes a gRPC storage-control call per bucket at first use (retried for
# ~60 s against emulators and private endpoints); it reads this variable when it is imported.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import re  # noqa: E402
from collections.abc import Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import fsspec  # noqa: E402
from fsspec.asyn import AsyncFileSystem  # noqa: E402

from otfload.errors import (  # noqa: E402
    OtfloadError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TruncatedFileError,
)
from otfload.sources.base import RangeRead  # noqa: E402
from otfload.sources.formats import check_safe_format, is_checkpoint_file  # noqa: E402
from otfload.sources.ranges import coalesce, read_runs  # noqa: E402
from otfload.sources.retry import RetriedCalls, RetryPolicy, TransientError, is_transient_status  # noqa: E402

_USERINFO = re.compile(r"(?<=://)[^/@]*@")  # "s3://key:secret@bucket" -> "s3://bucket" in messages


class FsspecSource(RetriedCalls):
    """The safetensors and JSON files under ``url``; ``storage_options`` go to the fsspec filesystem.

    For ``gs://`` they are gcsfs options, e.g. ``{"endpoint_url": "http://127.0.0.1:4443", "token": "anon"}``.
    """

    def __init__(self, url: str, storage_options: dict | None = None, retry: RetryPolicy | None = None):
        self.url = url.rstrip("/")
        self._retry = retry or RetryPolicy()
        try:
            self._fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise SourceError(f"{self.description}: cannot open ({type(e).__name__}: {e})") from e
        self._root = root.rstrip("/")
        # Async filesystems (gcsfs, s3fs, http) take a per-call timeout; local ones never wait.
        self._timeout = {"timeout": self._retry.attempt_timeout_s} if isinstance(self._fs, AsyncFileSystem) else {}
        found = self._call(lambda: self._fs.find(self._root, detail=True, **self._timeout))
        sizes = {path[len(self._root) + 1 :]: info["size"] for path, info in found.items() if path != self._root}
        if not sizes:
            raise SourceNotFoundError(f"{self.description}: no files there (missing bucket, prefix or directory?)")
        check_safe_format(sizes, self.description)
        self._sizes = {name: size for name, size in sizes.items() if is_checkpoint_file(name)}

    @property
    def description(self) -> str:
        return _USERINFO.sub("", self.url)

    def list_files(self) -> list[str]:
        return sorted(self._sizes)

    def size(self, file: str) -> int:
        size = self._sizes.get(file)
        if size is None:
            raise SourceNotFoundError(f"{file!r} not found in {self.description}")
        return size

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        want, size = len(out), self.size(file)
        if offset + want > size:
            raise TruncatedFileError(file, f"wanted {want} bytes at offset {offset}, file has {size}")
        if want == 0:
            return

        def attempt() -> None:
            data = self._fs.cat_file(f"{self._root}/{file}", start=offset, end=offset + want, **self._timeout)
            if len(data) != want:
                raise TransientError(f"got {len(data)} of {want} bytes")
            out.cast("B")[:] = data

        self._call(attempt, file)

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        read_runs(coalesce(reads), self.read_into)

    def close(self) -> None:
        """Nothing to release: fsspec shares filesystem instances (and their sessions) process-wide."""

    def __repr__(self) -> str:
        return f"FsspecSource({self.description!r})"


    @contextmanager
    def _translated(self, file: str | None) -> Iterator[None]:
        """Turn filesystem errors into otfload errors (permanent) or TransientError."""
        what = f"{self.description}: {file}" if file else self.description
        try:
            yield
        except (OtfloadError, TransientError):
            raise
        except FileNotFoundError as e:
            raise SourceNotFoundError(f"{what}: not found") from e
        except PermissionError as e:
            raise SourcePermissionError(f"{what}: access denied") from e
        except Exception as e:
            status = getattr(e, "code", None) or getattr(e, "status", None)  # gcsfs HttpError / aiohttp
            if isinstance(status, int):
                if status in (401, 403):
                    raise SourcePermissionError(f"{what}: HTTP {status}, credentials missing or lacking access") from e
                if not is_transient_status(status):
                    raise SourceError(f"{what}: HTTP {status}") from e
            elif not _looks_transient(e):
                raise SourceError(f"{what}: {type(e).__name__}: {e}") from e
            raise TransientError(f"{type(e).__name__}: {e}") from e


def _looks_transient(e: Exception) -> bool:
    """I/O and connection failures of a network filesystem (aiohttp's included) are worth a retry."""
    return isinstance(e, OSError | TimeoutError) or type(e).__module__.startswith("aiohttp")
