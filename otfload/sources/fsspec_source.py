"""A checkpoint under any fsspec URL (``gs://``, ``s3://``, ``hf://``, ``http(s)://``, ``memory://``, ``file://``).

Files are listed once when the source opens; tensors are read as byte ranges, several in parallel,
each under the shared retry policy and time bounds. On asynchronous filesystems (gcsfs, s3fs,
HTTP) every call runs on fsspec's event loop with its own deadline and is cancelled at it (or when
the load is cancelled); idle timeouts go to gcsfs, botocore and aiohttp. For ``gs://``, ``s3://``
(:mod:`otfload.sources.s3`) and ``http(s)://`` the range answer itself is checked
(``Content-Range``, lengths, encoding) before a byte is taken.
A large range is fetched as concurrent chunks of :data:`~otfload.accounting.requests.REMOTE_CHUNK_BYTES`
into the caller's buffer, never staged whole; at most
:data:`~otfload.sources.fetch_threads.MAX_REQUESTS_IN_FLIGHT` requests of a source are in flight at once,
over all its threads. The first chunk that fails for good cancels its siblings and is raised, typed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import fsspec
from fsspec.asyn import AsyncFileSystem

from otfload.accounting.gaps import DEFAULT_GAPS, GapPolicy
from otfload.accounting.requests import REMOTE_CHUNK_BYTES
from otfload.errors import (
    LoadCancelled,
    OtfloadError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    SourceProtocolError,
    TruncatedFileError,
)
from otfload.sources.base import MAX_FILE_BYTES, RangeRead
from otfload.sources.checkpoint_files import check_safe_format, is_checkpoint_file
from otfload.sources.fetch_threads import MAX_REQUESTS_IN_FLIGHT, read_chunked
from otfload.sources.range_answer import RangeSink, check_range_answer
from otfload.sources.retry import (
    Deadline,
    RequestSlots,
    RetriedCalls,
    RetryNotice,
    RetryPolicy,
    StallError,
    TransientError,
    current_token,
    is_transient_status,
)

T = TypeVar("T")

_USERINFO = re.compile(r"(?<=://)[^/@]*@")  # "s3://key:secret@bucket" -> "s3://bucket" in messages
# Body chunks of an HTTP range answer: large enough for GB/s, small enough to notice a long body early.
HTTP_CHUNK_BYTES = 1 << 20
S3_PROTOCOLS = ("s3", "s3a")  # s3fs's: opened by otfload.sources.s3 (imported only then: botocore is slow to import)


def open_filesystem(url: str, **options: Any) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of ``url`` and the path inside it.

    ``gs://`` gets gcsfs's core ``GCSFileSystem``: the experimental zonal/HNS class that ``import
    gcsfs`` registers by default makes a gRPC storage-control call per bucket at first use (retried
    for ~60 s against emulators and private endpoints), and switching it off through
    ``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT`` would mean changing the process environment on import.
    """
    if url.split("://", 1)[0] in ("gs", "gcs"):
        from gcsfs.core import GCSFileSystem

        fs = GCSFileSystem(**options)
        return fs, fs._strip_protocol(url)
    found: tuple[fsspec.AbstractFileSystem, str] = fsspec.core.url_to_fs(url, **options)
    return found


# Listing fields holding an object's published checksums, by algorithm (GCS JSON API names).
PUBLISHED_DIGESTS = {"md5": "md5Hash", "crc32c": "crc32c"}


class FsspecSource(RetriedCalls):
    """The safetensors and JSON files under ``url``; ``storage_options`` go to the fsspec filesystem.

    For ``gs://`` they are gcsfs options, e.g. ``{"endpoint_url": "http://127.0.0.1:4443", "token": "anon"}``;
    for ``s3://`` s3fs options, e.g. ``{"endpoint_url": "https://minio.example:9000", "key": ..., "secret": ...}``
    or ``{"anon": True}``.
    ``retry`` bounds every call (see :class:`RetryPolicy`); ``timeout`` (seconds, default
    ``OTFLOAD_TIMEOUT``, else none) is the total deadline of everything read through this source,
    counted from now: past it reads raise :class:`~otfload.errors.SourceTimeoutError`.
    """

    # A range is fetched as concurrent chunks of at most this many bytes (smaller ones in up to
    # READ_SPLIT pieces); at most this many requests are in flight at once (a subclass may choose
    # others; see otfload/accounting/requests.py).
    chunk_bytes: int = REMOTE_CHUNK_BYTES
    max_requests_in_flight: int = MAX_REQUESTS_IN_FLIGHT

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ):
        self._deadline = Deadline(timeout)
        self.url = url.rstrip("/")
        self._retry = retry or RetryPolicy()
        self._notice = RetryNotice()
        protocol = fsspec.core.split_protocol(self.url)[0] or "file"
        options = _with_idle_timeouts(protocol, dict(storage_options or {}), self._retry.read_timeout_s)
        try:
            if protocol in S3_PROTOCOLS:
                from otfload.sources.s3 import open_s3

                self._fs, root = open_s3(self.url, **options)
            else:
                self._fs, root = open_filesystem(self.url, **options)
        except (ImportError, ValueError, TypeError) as e:
            raise SourceError(f"{self.description}: cannot open ({type(e).__name__}: {e})") from e
        self._root = root.rstrip("/")
        self._slots = RequestSlots(self.max_requests_in_flight)
        self._async = isinstance(self._fs, AsyncFileSystem)
        self._http = protocol in ("http", "https")
        self._gcs = protocol in ("gs", "gcs") and hasattr(self._fs, "_call") and hasattr(self._fs, "url")
        self._s3 = protocol in S3_PROTOCOLS
        found = self._call(lambda: self._run(lambda: self._fs._find(self._root, detail=True), self._find_sync, 0))
        sizes = {path[len(self._root) + 1 :]: info.get("size") for path, info in found.items() if path != self._root}
        if not sizes:
            raise SourceNotFoundError(f"{self.description}: no files there (missing bucket, prefix or directory?)")
        check_safe_format(sizes, self.description)
        self._sizes = {name: self._checked_size(name, size) for name, size in sizes.items() if is_checkpoint_file(name)}
        # Object stores publish checksums in the listing (GCS ``md5Hash`` / ``crc32c``, base64): kept so
        # the shard cache can verify copies against the source's current object at no extra request.
        self._digests = {
            path[len(self._root) + 1 :]: {
                alg: info[key] for alg, key in PUBLISHED_DIGESTS.items() if isinstance(info.get(key), str)
            }
            for path, info in found.items()
            if path != self._root
        }

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

    def digests(self, file: str) -> dict[str, str]:
        """Checksums the store published for ``file`` in its listing (``md5``/``crc32c``, base64)."""
        return dict(self._digests.get(file, {}))

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        want, size = len(out), self.size(file)
        if offset + want > size:
            raise TruncatedFileError(file, f"wanted {want} bytes at offset {offset}, file has {size}")
        self.read_many([RangeRead(file, offset, out)])

    def read_many(self, reads: Sequence[RangeRead], gaps: GapPolicy = DEFAULT_GAPS) -> None:
        read_chunked(reads, self._read_range, self.chunk_bytes, self.max_requests_in_flight, gaps)

    def close(self) -> None:
        """Nothing to release: fsspec shares filesystem instances (and their sessions) process-wide."""

    def __repr__(self) -> str:
        return f"FsspecSource({self.description!r})"

    # --- internals -------------------------------------------------------------------------------

    def _read_range(self, file: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``file`` at ``offset``: one request (and its retries), in a request slot."""
        want, size = len(out), self.size(file)
        if offset + want > size:
            raise TruncatedFileError(file, f"wanted {want} bytes at offset {offset}, file has {size}")
        if want == 0:
            return
        out = out.cast("B")
        path = f"{self._root}/{file}"
        url = f"{self.description}/{file}"

        def attempt() -> None:
            with self._slots.hold(f"{self.description}: {file}"):
                fetch()

        def fetch() -> None:
            if self._http:
                self._run(lambda: self._http_range(path, url, offset, out, size), None, want)
            elif self._gcs:
                self._run(lambda: self._gcs_range(path, url, offset, out, size), None, want)
            elif self._s3:
                from otfload.sources.s3 import read_s3_range

                self._run(lambda: read_s3_range(self._fs, path, url, offset, out, size), None, want)
            else:
                cat = lambda: self._fs._cat_file(path, start=offset, end=offset + want)  # noqa: E731
                data = self._run(cat, lambda: self._fs.cat_file(path, start=offset, end=offset + want), want)
                if len(data) > want:
                    raise SourceProtocolError(f"{url}: asked for {want} bytes at {offset}, got {len(data)}")
                if len(data) < want:
                    raise TransientError(f"got {len(data)} of {want} bytes")
                out[:] = data

        self._call(attempt, file, url=url)

    def _checked_size(self, name: str, size: object) -> int:
        """A listed size, asked for separately when the listing has none (HTTP directory pages)."""
        if size is None:
            path = f"{self._root}/{name}"
            info = self._call(lambda: self._run(lambda: self._fs._info(path), lambda: self._fs.info(path), 0), name)
            size = info.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
            raise SourceProtocolError(
                f"{self.description}: {name!r} is listed with size {size!r}, "
                f"expected an integer in [0, {MAX_FILE_BYTES}]"
            )
        return size

    def _find_sync(self) -> dict[str, dict[str, Any]]:
        """``{path: fsspec info}`` of every file under the root."""
        found: dict[str, dict[str, Any]] = self._fs.find(self._root, detail=True)
        return found

    def _run(self, make: Callable[[], Awaitable[T]], sync_call: Callable[[], T] | None, nbytes: int) -> T:
        """One call: on an async filesystem, ``make()`` on fsspec's loop, cancelled at the attempt's
        deadline or when the load is cancelled; else ``sync_call()`` (local-like filesystems)."""
        if not self._async:
            assert sync_call is not None
            return sync_call()
        until = self._retry.attempt_until(nbytes, self._deadline)
        left = until - time.monotonic()
        if left <= 0:
            raise StallError("no time left for another request")
        future = asyncio.run_coroutine_threadsafe(_within(make(), left), self._fs.loop)
        token = current_token()
        unregister = token.on_cancel(future.cancel) if token is not None else (lambda: None)
        try:
            return future.result()
        except concurrent.futures.CancelledError as e:
            raise LoadCancelled(f"{self.description}: cancelled, another read of this load failed") from e
        finally:
            unregister()

    async def _http_range(self, path: str, url: str, offset: int, out: memoryview, size: int) -> None:
        """Checked Range GETs through the HTTP filesystem's own aiohttp session (more than one only
        when the server sends shorter ranges than asked)."""
        fs: Any = self._fs
        kwargs = dict(fs.kwargs)
        base = {**kwargs.pop("headers", {}), "Accept-Encoding": "identity"}  # byte ranges of the stored bytes
        session = await fs.set_session()
        done = 0
        while done < len(out):
            start, last = offset + done, offset + len(out) - 1
            headers = {**base, "Range": f"bytes={start}-{last}"}
            async with session.get(fs.encode_url(path), headers=headers, **kwargs) as r:
                if r.status == 404:
                    raise FileNotFoundError(url)
                r.raise_for_status()
                answer = check_range_answer(r.status, r.headers, url, start, last, size)
                sink = RangeSink(answer, out, done, f"{url} (bytes {start}-{last})")
                while chunk := await r.content.read(HTTP_CHUNK_BYTES):
                    if sink.feed(chunk):
                        break
                sink.finish()
            if sink.done == done:
                raise TransientError(f"no progress at byte {start}")
            done = sink.done

    async def _gcs_range(self, path: str, url: str, offset: int, out: memoryview, size: int) -> None:
        """A checked Range GET through gcsfs (its auth, retries and endpoint)."""
        fs: Any = self._fs
        last = offset + len(out) - 1
        headers, data = await fs._call("GET", fs.url(path), headers={"Range": f"bytes={offset}-{last}"})
        answer = check_range_answer(200 if "Content-Range" not in headers else 206, headers, url, offset, last, size)
        sink = RangeSink(answer, out, 0, url)
        sink.feed(data)
        sink.finish()
        if sink.done < len(out):
            raise TransientError(f"a shorter range than asked: {sink.done} of {len(out)} bytes")

    @contextmanager
    def _translated(self, file: str | None, url: str = "") -> Iterator[None]:
        """Turn filesystem errors into otfload errors (permanent) or TransientError."""
        what = f"{self.description}: {file}" if file else self.description
        try:
            yield
        except (OtfloadError, TransientError):
            raise
        except TimeoutError as e:
            raise StallError(f"{type(e).__name__}: no complete answer within the attempt's time") from e
        except FileNotFoundError as e:
            raise SourceNotFoundError(f"{what}: not found") from e
        except PermissionError as e:
            raise SourcePermissionError(f"{what}: access denied") from e
        except Exception as e:
            status = getattr(e, "status", None)  # aiohttp
            if not isinstance(status, int):
                status = getattr(e, "code", None)  # gcsfs HttpError
            transient = _looks_transient(e)
            if self._s3:  # botocore's errors, or the OSErrors s3fs made of them
                from otfload.sources.s3 import is_s3_transient, lacks_credentials, s3_status

                if lacks_credentials(e):
                    raise SourcePermissionError(
                        f"{what}: no S3 credentials found; give key= and secret= in storage_options, "
                        "set up the AWS credential chain, or pass anon=True for a public bucket"
                    ) from e
                status = status if isinstance(status, int) else s3_status(e)
                transient = transient or is_s3_transient(e)
            if _is_protocol_error(e):
                raise SourceProtocolError(f"{what}: {type(e).__name__}: {e}") from e
            if isinstance(status, int) and status >= 100:
                if status in (401, 403):
                    raise SourcePermissionError(f"{what}: HTTP {status}, credentials missing or lacking access") from e
                if not is_transient_status(status):
                    raise SourceError(f"{what}: HTTP {status}") from e
            elif not transient:
                raise SourceError(f"{what}: {type(e).__name__}: {e}") from e
            raise TransientError(f"{type(e).__name__}: {e}") from e


async def _within(coro: Awaitable[T], seconds: float) -> T:
    return await asyncio.wait_for(coro, seconds)


def _with_idle_timeouts(protocol: str, options: dict[str, Any], idle_s: float) -> dict[str, Any]:
    """Give gcsfs, botocore and aiohttp an idle timeout (connect, next bytes) unless the caller chose one."""
    if protocol in S3_PROTOCOLS:
        from otfload.sources.s3 import with_s3_timeouts

        return with_s3_timeouts(options, idle_s)
    if protocol not in ("gs", "gcs", "http", "https"):
        return options
    import aiohttp

    idle = aiohttp.ClientTimeout(total=None, sock_connect=idle_s, sock_read=idle_s)
    if protocol in ("gs", "gcs"):
        options.setdefault("requests_timeout", idle)
    else:
        options["client_kwargs"] = {"timeout": idle, **options.get("client_kwargs", {})}
    return options


def _is_protocol_error(e: Exception) -> bool:
    """aiohttp's "too many redirects" and undecodable bodies: retrying cannot help."""
    return type(e).__name__ in ("TooManyRedirects", "ContentEncodingError") or "content-encoding" in str(e).lower()


def _looks_transient(e: Exception) -> bool:
    """I/O and connection failures of a network filesystem (aiohttp's included) are worth a retry."""
    return isinstance(e, OSError | TimeoutError) or type(e).__module__.startswith("aiohttp")
