"""A Hugging Face Hub model repo as a source, read by HTTP byte ranges through ``huggingface_hub``'s client.

The revision is pinned to a commit when the source opens (one revision-info request, the one
``model_info(files_metadata=True)`` makes, gives the commit, the file sizes and LFS sha256s; the
answer is checked field by field), so every later read sees the same files. Files already in the HF
cache for that commit are read from disk; the rest by ``Range`` requests on ``resolve`` URLs, each
answer checked (``Content-Range``, lengths, encoding) before a byte is taken, and every request
bounded by the idle, attempt and total time limits of :mod:`otfload.sources.retry`.
A large range (a 500 MB embedding read whole) is fetched as concurrent chunks of
:data:`~otfload.accounting.requests.REMOTE_CHUNK_BYTES` straight into the caller's buffer, never staged
whole; every request of the source, whichever thread sends it, takes one of
:data:`~otfload.sources.fetch_threads.MAX_REQUESTS_IN_FLIGHT` slots. The first chunk that fails for good
cancels its siblings (their requests are cut) and its own typed error is raised.
Offline (``local_files_only`` or ``HF_HUB_OFFLINE``), only the cached snapshot is used.
Both ``huggingface_hub`` majors are supported, 1.x (httpx) and 2.x (httpx2): see :mod:`otfload.sources.hub_http`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import urllib3
from huggingface_hub import constants
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import (  # type: ignore[attr-defined, unused-ignore]
    # re-exported lazily (a computed __all__), which strict mypy's no_implicit_reexport rejects; the
    # ignore is unused while the third-party module is checked leniently
    build_hf_headers,
    get_session,
    hf_raise_for_status,
)

from otfload.accounting.gaps import DEFAULT_GAPS, GapPolicy
from otfload.accounting.requests import REMOTE_CHUNK_BYTES
from otfload.errors import (
    ChecksumMismatchError,
    OtfloadError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    SourceProtocolError,
    SourceUnavailableError,
    TruncatedFileError,
)
from otfload.sources import http_body
from otfload.sources.base import MAX_FILE_BYTES, RangeRead
from otfload.sources.checkpoint_files import CHECKPOINT_SUFFIXES, check_safe_format, is_checkpoint_file
from otfload.sources.fetch_threads import MAX_REQUESTS_IN_FLIGHT, read_chunked, read_runs
from otfload.sources.hub_http import httpx
from otfload.sources.local import LocalSource
from otfload.sources.names import check_member_name
from otfload.sources.range_answer import RangeSink, check_range_answer
from otfload.sources.retry import (
    Deadline,
    RequestSlots,
    RetriedCalls,
    RetryNotice,
    RetryPolicy,
    StallError,
    TransientError,
    interrupt_at,
    is_transient_status,
)
from otfload.sources.runs import coalesce

PUBLIC_HUB = "https://huggingface.co"  # descriptions name the endpoint only when it is another one
# Whole-file downloads go through this much memory at a time, fetched as parallel pieces: every
# request slot busy with one chunk (16 x 8 MiB = 128 MiB of host memory), as a load's reads are.
DOWNLOAD_PIECE_BYTES = REMOTE_CHUNK_BYTES
DOWNLOAD_WINDOW_BYTES = MAX_REQUESTS_IN_FLIGHT * DOWNLOAD_PIECE_BYTES
# Revision metadata accepted: model_info with blobs for a 100k-file repo is ~20 MB; more is not JSON
# the Hub would send, and must not be buffered without end.
MAX_METADATA_BYTES = 64 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}")  # a git object id: it names a cache folder/blob, so nothing else passes
_SHA256 = re.compile(r"[0-9a-f]{64}")
# Ends the notice of a Hub whose requests keep failing (see otfload.sources.retry.RetryNotice).
OFFLINE_HINT = "set HF_HUB_OFFLINE=1 to use the local Hub cache only"


class _Entry(NamedTuple):
    size: int
    sha256: str | None  # the LFS oid, when the Hub publishes one
    blob_id: str | None = None  # the git blob id of a file not in LFS, when the Hub publishes one


class HubSource(RetriedCalls):
    """The safetensors and JSON files of a Hub model repo at one commit.

    ``endpoint`` defaults to ``HF_ENDPOINT`` (read now, not at import), ``cache_dir`` to the HF cache
    (``HF_HOME``/``HF_HUB_CACHE``); ``token`` defaults to the saved HF token and is never shown.
    ``retry`` bounds every network operation (see :class:`RetryPolicy`); ``timeout`` (seconds, default
    ``OTFLOAD_TIMEOUT``, else none) is the total deadline of everything read through this source,
    counted from now: past it reads raise :class:`~otfload.errors.SourceTimeoutError`. Requests
    still failing after ``retry.notice_after_s`` are announced once, with :data:`OFFLINE_HINT`.
    """

    # A range is fetched as concurrent chunks of at most this many bytes (smaller ones in up to
    # READ_SPLIT pieces); at most this many requests are in flight at once (a subclass may choose
    # others; see otfload/accounting/requests.py).
    chunk_bytes: int = REMOTE_CHUNK_BYTES
    max_requests_in_flight: int = MAX_REQUESTS_IN_FLIGHT

    def __init__(
        self,
        repo_id: str,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        local_files_only: bool = False,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ):
        self._deadline = Deadline(timeout)
        self.repo_id = repo_id
        self.revision = revision or constants.DEFAULT_REVISION
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.cache_dir = Path(cache_dir or constants.HF_HUB_CACHE).expanduser()
        self.local_files_only = local_files_only or constants.is_offline_mode()
        self._token = token
        self._retry = retry or RetryPolicy()
        self._notice = RetryNotice(OFFLINE_HINT)
        self._storage = self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        self._cache: LocalSource | None = None
        self._slots = RequestSlots(self.max_requests_in_flight)
        self._connections = http_body.Connections()
        self.commit, self._files, names = self._open_cached() if self.local_files_only else self._open_remote()
        check_safe_format(names, self.description)
        self._cached = {f for f in self._files if self._snapshot_path(f).is_file()}

    # --- opening ---------------------------------------------------------------------------------

    def _open_remote(self) -> tuple[str, dict[str, _Entry], list[str]]:
        """Pin the revision to a commit and list every file with its size and LFS sha256.

        The request is the one ``HfApi.model_info(files_metadata=True)`` makes, but bounded in time
        and size, and its answer is checked field by field (a broken server is a typed error).
        """
        url = f"{self.endpoint}/api/models/{self.repo_id}/revision/{quote(self.revision, safe='')}?blobs=true"
        try:
            body = self._call(lambda: self._get_small(url, MAX_METADATA_BYTES), url=url)
        except SourceUnavailableError as e:
            if type(e) is not SourceUnavailableError:  # a timeout keeps its type and fields
                raise
            raise SourceUnavailableError(
                f"{e}. Without a network, HF_HUB_OFFLINE=1 (or local_files_only=True) "
                f"loads the revision from the local Hub cache ({self.cache_dir})"
            ) from e
        return _parse_revision_info(body, f"{self.description}: revision metadata from {url}")

    def _open_cached(self) -> tuple[str, dict[str, _Entry], list[str]]:
        """The cached snapshot of the revision (no network); sha256s are not known offline."""
        from huggingface_hub import snapshot_download  # imports HfApi (~70 ms): only offline opens need it

        try:
            snapshot = Path(
                snapshot_download(
                    self.repo_id,
                    revision=self.revision,
                    cache_dir=self.cache_dir,
                    local_files_only=True,
                    allow_patterns=[f"*{suffix}" for suffix in CHECKPOINT_SUFFIXES],
                )
            )
        except LocalEntryNotFoundError as e:
            raise SourceNotFoundError(
                f"{self.description}: not in the local Hub cache {str(self.cache_dir)!r} (offline mode)"
            ) from e
        names = [p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file()]
        files = {n: _Entry(os.path.getsize(snapshot / n), None) for n in names if is_checkpoint_file(n)}
        return snapshot.name, files, names

    # --- the Source protocol ---------------------------------------------------------------------

    @property
    def description(self) -> str:
        where = "" if self.endpoint == PUBLIC_HUB else f" at {self.endpoint}"
        return f"hub:{self.repo_id}@{self.revision}{where}"

    def list_files(self) -> list[str]:
        return sorted(self._files)

    def size(self, file: str) -> int:
        return self._entry(file).size

    def sha256(self, file: str) -> str | None:
        """The sha256 the Hub publishes for ``file`` (LFS files, when online), else None."""
        return self._entry(file).sha256

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        if not self._check_range(file, offset, len(out)):
            return
        if file in self._cached:
            self._local().read_into(self._snapshot_relpath(file), offset, out)
        else:
            read_chunked(
                [RangeRead(file, offset, out)],
                self._read_remote_into,
                self.chunk_bytes,
                self.max_requests_in_flight,
                DEFAULT_GAPS,
            )

    def read_many(self, reads: Sequence[RangeRead], gaps: GapPolicy = DEFAULT_GAPS) -> None:
        read_chunked(reads, self._read_run, self.chunk_bytes, self.max_requests_in_flight, gaps)

    def close(self) -> None:
        self._connections.close()
        if self._cache is not None:
            self._cache.close()

    def __repr__(self) -> str:
        return f"HubSource({self.repo_id!r}, revision={self.revision!r}, endpoint={self.endpoint!r})"

    # --- whole-file copies -----------------------------------------------------------------------

    def download(self, file: str) -> str:
        """Path of a complete local copy of ``file`` in the HF cache, downloading it if needed.

        The copy is fetched by the same bounded, checked range reads as :meth:`read_into` (so the
        idle, attempt and total time bounds hold), hashed while it is written to a private temporary
        file, and checked against the Hub's LFS sha256 (or git blob id) before it is renamed into
        ``blobs/`` and linked from the snapshot, as ``huggingface_hub`` lays it out. On a mismatch
        nothing is kept and :class:`~otfload.errors.ChecksumMismatchError` is raised.
        """
        entry = self._entry(file)
        if file in self._cached:
            return str(self._snapshot_path(file))
        check_member_name(file, self.description, SourceProtocolError)
        blobs = self._storage / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        tmp = blobs / f".{secrets.token_hex(8)}.otfload-{os.getpid()}.incomplete"
        sha256, git = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % entry.size)
        try:
            with open(tmp, "wb") as f:
                for start in range(0, entry.size, DOWNLOAD_WINDOW_BYTES):
                    window = memoryview(bytearray(min(DOWNLOAD_WINDOW_BYTES, entry.size - start)))
                    reads = [RangeRead(file, start, window)]
                    read_runs(coalesce(reads, max_run=DOWNLOAD_PIECE_BYTES), self._read_remote_into)
                    f.write(window)
                    sha256.update(window)
                    if entry.sha256 is None and entry.blob_id is not None:
                        git.update(window)
            if entry.sha256 is not None and sha256.hexdigest() != entry.sha256:
                raise ChecksumMismatchError(
                    f"{self.description}: {file} downloaded with sha256 {sha256.hexdigest()}, the Hub says "
                    f"{entry.sha256}; the cached copy was deleted"
                )
            if entry.sha256 is None and entry.blob_id is not None and git.hexdigest() != entry.blob_id:
                raise ChecksumMismatchError(
                    f"{self.description}: {file} downloaded with git blob id {git.hexdigest()}, the Hub says "
                    f"{entry.blob_id}; the cached copy was deleted"
                )
            blob = blobs / (entry.sha256 or entry.blob_id or sha256.hexdigest())
            os.replace(tmp, blob)
        finally:
            tmp.unlink(missing_ok=True)
        link = self._snapshot_path(file)
        link.parent.mkdir(parents=True, exist_ok=True)
        tmp_link = link.parent / f".{secrets.token_hex(8)}.otfload-link"
        os.symlink(os.path.relpath(blob, link.parent), tmp_link)
        os.replace(tmp_link, link)
        self._cached.add(file)
        self._record_ref()
        return str(link)

    def _read_remote_into(self, file: str, offset: int, out: memoryview) -> None:
        self._read_remote(file, offset, out.cast("B"))

    def _read_run(self, file: str, offset: int, out: memoryview) -> None:
        """One run of :meth:`read_many` (at most a chunk): from the cached copy if there is one."""
        if not self._check_range(file, offset, len(out)):
            return
        if file in self._cached:
            self._local().read_into(self._snapshot_relpath(file), offset, out)
        else:
            self._read_remote(file, offset, out.cast("B"))

    def _record_ref(self) -> None:
        """Map the revision name to the pinned commit in the cache, so offline opens find the snapshot."""
        ref = self._storage / "refs" / self.revision
        if self.revision != self.commit and not (ref.is_file() and ref.read_text() == self.commit):
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(self.commit)

    # --- internals -------------------------------------------------------------------------------

    def _check_range(self, file: str, offset: int, want: int) -> bool:
        """Whether there is anything to read; a range past the end is :class:`TruncatedFileError`."""
        if offset + want > self.size(file):
            raise TruncatedFileError(file, f"wanted {want} bytes at offset {offset}, file has {self.size(file)}")
        return want > 0

    def _entry(self, file: str) -> _Entry:
        entry = self._files.get(file)
        if entry is None:
            raise SourceNotFoundError(f"{file!r} not found in {self.description} (commit {self.commit})")
        return entry

    def _snapshot_relpath(self, file: str) -> str:
        return f"snapshots/{self.commit}/{file}"

    def _snapshot_path(self, file: str) -> Path:
        return self._storage / self._snapshot_relpath(file)

    def _local(self) -> LocalSource:
        # Rooted at the repo's cache folder: snapshot files are symlinks into its blobs/.
        if self._cache is None:
            self._cache = LocalSource(self._storage)
        return self._cache

    def _resolve_url(self, file: str) -> str:
        return f"{self.endpoint}/{self.repo_id}/resolve/{self.commit}/{quote(file)}"

    def _headers(self) -> dict[str, str]:
        headers = build_hf_headers(token=self._token, library_name="otfload")
        headers["Accept-Encoding"] = "identity"  # byte ranges of the stored bytes, not of a compressed body
        return headers

    def _idle_s(self, until: float) -> float:
        """How long one wait (connect, headers, next bytes) may last in an attempt ending at ``until``."""
        idle = min(self._retry.read_timeout_s, until - time.monotonic())
        if idle <= 0:
            raise StallError("no time left for another request")
        return idle

    @contextmanager
    def _stream(
        self, url: str, headers: dict[str, str], until: float
    ) -> Iterator[tuple[httpx.Response, Callable[[], bool]]]:
        """GET ``url`` through ``huggingface_hub``'s client; the response must be fully handled by
        monotonic time ``until``.

        Each wait (connect, headers, next bytes) is bounded by the idle timeout; once the headers are
        in, the socket is shut at ``until`` (or when the load is cancelled), which ends a dripping
        body. Yields the response and a function telling whether that cut happened.
        """
        with get_session().stream("GET", url, headers=headers, timeout=httpx.Timeout(self._idle_s(until))) as r:
            sock = _socket_of(r)
            with interrupt_at(until, lambda: http_body.shutdown(sock)) as cut:
                yield r, cut

    def _get_small(self, url: str, limit: int) -> bytes:
        """The body of a bounded GET of ``url`` (JSON metadata): at most ``limit`` bytes."""
        until = self._retry.attempt_until(0, self._deadline)
        received = 0
        cut: Callable[[], bool] = lambda: False  # noqa: E731 - replaced once the headers are in
        try:
            with self._stream(url, build_hf_headers(token=self._token, library_name="otfload"), until) as (r, cut):
                _raise_for_status(r.status_code, r.headers.multi_items(), r.read, url)
                body = bytearray()
                for chunk in r.iter_bytes():
                    body += chunk
                    received = len(body)
                    if len(body) > limit:
                        raise SourceProtocolError(f"{self.description}: {url} sent more than {limit} bytes of metadata")
                return bytes(body)
        except httpx.TransportError as e:
            if cut():
                raise StallError(f"no complete answer within the attempt's time ({received} bytes)", received) from e
            raise

    def _read_remote(self, file: str, offset: int, out: memoryview) -> None:
        """Fill ``out`` from ``file`` at ``offset`` by Range requests, checking every answer.

        A ``206`` must carry the ``Content-Range`` asked for (it may end early: the rest is asked
        next), of a file of the listed size, and exactly that many bytes; a ``200`` (Range ignored) is
        sliced when it is the whole file and the skip is small. A body cut short keeps what arrived
        (less the piece in progress, :data:`~otfload.sources.http_body.BODY_PIECE_BYTES`, when the
        connection breaks with an error) and the retry asks only for the rest; anything else is
        :class:`SourceProtocolError`.
        """
        url = self._resolve_url(file)
        where = f"{self.description}: {url}"
        headers = self._headers()
        want, size = len(out), self.size(file)
        done = 0  # bytes already in ``out``: a retry resumes after them

        def one_request(until: float) -> None:
            nonlocal done
            start, last = offset + done, offset + want - 1
            headers["Range"] = f"bytes={start}-{last}"
            cut: Callable[[], bool] = lambda: False  # noqa: E731 - replaced once the headers are in
            try:
                with self._connections.get(url, headers, self._idle_s(until)) as r:
                    sock = http_body.socket_of(r)
                    with interrupt_at(until, lambda: http_body.shutdown(sock)) as cut:
                        _raise_for_status(r.status, r.headers.items(), lambda: http_body.error_body(r), url)
                        answer = check_range_answer(r.status, r.headers, where, start, last, size)
                        sink = RangeSink(answer, out, done, f"{where} (bytes {start}-{last})")
                        try:  # a broken body keeps what arrived
                            sink.drain(http_body.body_reader(r), http_body.BODY_PIECE_BYTES)
                        finally:
                            done = sink.done
                        sink.finish()
            except urllib3.exceptions.HTTPError as e:
                if cut():
                    raise StallError(
                        f"{type(e).__name__}: no complete answer within the attempt's time; "
                        f"{done} of {want} bytes received",
                        done,
                    ) from e
                raise

        def attempt() -> None:
            with self._slots.hold(f"{self.description}: {file}"):
                until = self._retry.attempt_until(want - done, self._deadline)
                while done < want:  # more than one request only when a server sends a shorter range
                    before = done
                    one_request(until)
                    if done == before:
                        raise TransientError(f"no progress at byte {offset + done}")

        self._call(attempt, file, url=url, progress=lambda: done)

    @contextmanager
    def _translated(self, file: str | None, url: str = "") -> Iterator[None]:
        """Turn ``huggingface_hub``/HTTP errors into otfload errors (permanent) or TransientError."""
        what = f"{self.description}: {file}" if file else self.description
        at = f" ({url})" if url else ""
        try:
            yield
        except (OtfloadError, TransientError):
            raise
        except OfflineModeIsEnabled as e:
            raise SourceError(f"{what}: offline mode is enabled (HF_HUB_OFFLINE) but the file is not cached") from e
        except RepositoryNotFoundError as e:
            raise SourceNotFoundError(
                f"{what}: repository not found (or private/gated and the token gives no access)"
            ) from e
        except RevisionNotFoundError as e:
            raise SourceNotFoundError(f"{what}: revision {self.revision!r} not found") from e
        except EntryNotFoundError as e:
            if isinstance(e, LocalEntryNotFoundError) and not self.local_files_only:
                raise TransientError("the Hub could not be reached for file metadata") from e
            raise SourceNotFoundError(f"{what}: file not found") from e
        except HfHubHTTPError as e:
            status = e.response.status_code
            if status in (401, 403):
                raise SourcePermissionError(
                    f"{what}: HTTP {status}, the token is missing, invalid or lacks access"
                ) from e
            if is_transient_status(status):
                raise TransientError(f"HTTP {status}") from e
            raise SourceError(f"{what}: HTTP {status}{at}") from e
        except urllib3.exceptions.HTTPError as e:
            raise _from_urllib3(e, what, url, self._retry.read_timeout_s) from e
        except httpx.TimeoutException as e:
            raise StallError(f"{type(e).__name__}: nothing received for {self._retry.read_timeout_s:g}s") from e
        except httpx.TooManyRedirects as e:
            raise SourceProtocolError(f"{what}: {url or 'the request'} redirects in a loop ({e})") from e
        except httpx.DecodingError as e:
            raise SourceProtocolError(f"{what}: the body from {url or 'the server'} does not decode "
                                      f"as its Content-Encoding says ({e})") from e  # fmt: skip
        except httpx.UnsupportedProtocol as e:
            raise SourceProtocolError(f"{what}: redirected to an unsupported URL ({e})") from e
        except httpx.TransportError as e:
            raise TransientError(f"{type(e).__name__}: {e}") from e
        except (httpx.RequestError, httpx.InvalidURL) as e:
            raise SourceProtocolError(f"{what}: {type(e).__name__}: {e}{at}") from e


def _socket_of(r: httpx.Response) -> socket.socket | None:
    stream = r.extensions.get("network_stream")
    return stream.get_extra_info("socket") if stream is not None else None


def _raise_for_status(status: int, headers: Iterable[tuple[str, str]], body: Callable[[], bytes], url: str) -> None:
    """Raise the ``huggingface_hub`` error for a 4xx/5xx (``body`` gives the answer's, for its
    message); any other non-2xx status is a protocol error."""
    if status >= 400:
        answer = httpx.Response(status, headers=list(headers), content=body(), request=httpx.Request("GET", url))
        hf_raise_for_status(answer)
    if not 200 <= status < 300:
        raise SourceProtocolError(f"{url}: unexpected HTTP {status}")


def _from_urllib3(e: urllib3.exceptions.HTTPError, what: str, url: str, idle_s: float) -> Exception:
    """The otfload error (or :class:`TransientError`) for a failed range GET."""
    reason = e.reason if isinstance(e, urllib3.exceptions.MaxRetryError) and e.reason is not None else e
    if isinstance(reason, urllib3.exceptions.ResponseError):  # what MaxRetryError says of a redirect loop
        return SourceProtocolError(f"{what}: {url or 'the request'} redirects in a loop ({reason})")
    if isinstance(reason, urllib3.exceptions.TimeoutError):
        return StallError(f"{type(reason).__name__}: nothing received for {idle_s:g}s")
    if isinstance(reason, urllib3.exceptions.LocationValueError):
        return SourceProtocolError(f"{what}: redirected to an unsupported URL ({reason})")
    return TransientError(f"{type(reason).__name__}: {reason}")


def _parse_revision_info(body: bytes, what: str) -> tuple[str, dict[str, _Entry], list[str]]:
    """(commit, checkpoint files, every listed name) from a ``/api/models/{repo}/revision/{rev}`` answer."""
    try:
        info = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise SourceProtocolError(f"{what} is not JSON ({e})") from e
    if not isinstance(info, dict):
        raise SourceProtocolError(f"{what} is a JSON {type(info).__name__}, expected an object")
    commit = info.get("sha")
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
        raise SourceProtocolError(f"{what}: 'sha' is {_short(commit)}, expected a 40-hex commit id")
    siblings = info.get("siblings")
    if not isinstance(siblings, list):
        raise SourceProtocolError(f"{what}: 'siblings' is {_short(siblings)}, expected a list of files")
    files: dict[str, _Entry] = {}
    names: list[str] = []
    for i, sib in enumerate(siblings):
        name = sib.get("rfilename") if isinstance(sib, dict) else None
        if not isinstance(name, str):
            raise SourceProtocolError(f"{what}: siblings[{i}] has rfilename {_short(name)}, expected a string")
        names.append(name)
        if not is_checkpoint_file(name):
            continue
        size = sib.get("size")
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_FILE_BYTES:
            raise SourceProtocolError(
                f"{what}: {name!r} has size {_short(size)}, expected an integer in [0, {MAX_FILE_BYTES}]"
            )
        lfs = sib.get("lfs")
        sha256 = lfs.get("sha256") if isinstance(lfs, dict) else None
        if lfs is not None and not (isinstance(sha256, str) and _SHA256.fullmatch(sha256)):
            raise SourceProtocolError(f"{what}: {name!r} has LFS metadata {_short(lfs)}, expected a sha256")
        blob_id = sib.get("blobId")
        if blob_id is not None and not (isinstance(blob_id, str) and _COMMIT.fullmatch(blob_id)):
            raise SourceProtocolError(f"{what}: {name!r} has blobId {_short(blob_id)}, expected a git object id")
        if name in files:
            raise SourceProtocolError(f"{what}: {name!r} is listed twice")
        files[name] = _Entry(size, sha256, blob_id)
    return commit, files, names


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
