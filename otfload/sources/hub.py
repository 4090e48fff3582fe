"""A Hugging Face Hub model repo as a source, read by HTTP byte ranges through ``huggingface_hub``.

The revision is pinned to a commit when the source opens (one ``model_info`` call gives the commit,
the file sizes and LFS sha256s), so every later read sees the same files. Files already in the HF
cache for that commit are read from disk; the rest by ``Range`` requests on ``resolve`` URLs.
Offline (``local_files_only`` or ``HF_HUB_OFFLINE``), only the cached snapshot is used.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple
from urllib.parse import quote

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.file_download import repo_folder_name
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

from otfload.errors import (
    ChecksumMismatchError,
    OtfloadError,
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    TruncatedFileError,
)
from otfload.sources.base import RangeRead
from otfload.sources.formats import CHECKPOINT_SUFFIXES, check_safe_format, is_checkpoint_file
from otfload.sources.local import LocalSource
from otfload.sources.ranges import coalesce, read_runs
from otfload.sources.retry import RetriedCalls, RetryPolicy, TransientError, is_transient_status

PUBLIC_HUB = "https://huggingface.co"  # descriptions name the endpoint only when it is another one
HASH_CHUNK_BYTES = 8 << 20  # sha256 verification reads: large enough to run at hashing speed


class _Entry(NamedTuple):
    size: int
    sha256: str | None  # the LFS oid, when the Hub publishes one


class HubSource(RetriedCalls):
    """The safetensors and JSON files of a Hub model repo at one commit.

    ``endpoint`` defaults to ``HF_ENDPOINT`` (read now, not at import), ``cache_dir`` to the HF cache
    (``HF_HOME``/``HF_HUB_CACHE``); ``token`` defaults to the saved HF token and is never shown.
    ``retry`` bounds every network operation (see :class:`RetryPolicy`).
    """

    def __init__(
        self,
        repo_id: str,
        revision: str | None = None,
        token: str | None = None,
        endpoint: str | None = None,
        cache_dir: str | os.PathLike | None = None,
        local_files_only: bool = False,
        retry: RetryPolicy | None = None,
    ):
        self.repo_id = repo_id
        self.revision = revision or constants.DEFAULT_REVISION
        self.endpoint = (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        self.cache_dir = Path(cache_dir or constants.HF_HUB_CACHE).expanduser()
        self.local_files_only = local_files_only or constants.is_offline_mode()
        self._token = token
        self._retry = retry or RetryPolicy()
        self._storage = self.cache_dir / repo_folder_name(repo_id=repo_id, repo_type="model")
        self._cache: LocalSource | None = None
        self.commit, self._files, names = self._open_cached() if self.local_files_only else self._open_remote()
        check_safe_format(names, self.description)
        self._cached = {f for f in self._files if self._snapshot_path(f).is_file()}

    # --- opening ---------------------------------------------------------------------------------

    def _open_remote(self) -> tuple[str, dict[str, _Entry], list[str]]:
        """Pin the revision to a commit and list every file with its size and LFS sha256."""
        api = HfApi(endpoint=self.endpoint, token=self._token, library_name="otfload")
        info = self._call(
            lambda: api.model_info(
                self.repo_id, revision=self.revision, files_metadata=True, timeout=self._retry.attempt_timeout_s
            )
        )
        siblings = info.siblings or []
        if any(s.size is None for s in siblings):
            raise SourceError(f"{self.description}: the Hub did not report file sizes")
        files = {
            s.rfilename: _Entry(s.size, s.lfs.sha256 if s.lfs else None)
            for s in siblings
            if is_checkpoint_file(s.rfilename)
        }
        return info.sha, files, [s.rfilename for s in siblings]

    def _open_cached(self) -> tuple[str, dict[str, _Entry], list[str]]:
        """The cached snapshot of the revision (no network); sha256s are not known offline."""
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
        want = len(out)
        if offset + want > self.size(file):
            raise TruncatedFileError(file, f"wanted {want} bytes at offset {offset}, file has {self.size(file)}")
        if want == 0:
            return
        if file in self._cached:
            self._local().read_into(self._snapshot_relpath(file), offset, out)
        else:
            self._read_remote(file, offset, out.cast("B"))

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        read_runs(coalesce(reads), self.read_into)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()

    def __repr__(self) -> str:
        return f"HubSource({self.repo_id!r}, revision={self.revision!r}, endpoint={self.endpoint!r})"

    # --- whole-file copies -----------------------------------------------------------------------

    def download(self, file: str) -> str:
        """Path of a complete local copy of ``file`` in the HF cache, downloading it if needed.

        A fresh download is checked against the Hub's LFS sha256; on mismatch the cache entry is
        deleted and :class:`~otfload.errors.ChecksumMismatchError` raised.
        """
        entry = self._entry(file)
        if file in self._cached:
            return str(self._snapshot_path(file))
        path = self._call(
            lambda: hf_hub_download(
                self.repo_id,
                file,
                revision=self.commit,
                cache_dir=self.cache_dir,
                token=self._token,
                endpoint=self.endpoint,
                etag_timeout=self._retry.attempt_timeout_s,
            ),
            file,
        )
        if entry.sha256 is not None:
            self._verify(file, Path(path), entry.sha256)
        self._cached.add(file)
        self._record_ref()
        return path

    def _record_ref(self) -> None:
        """Map the revision name to the pinned commit in the cache, so offline opens find the snapshot."""
        ref = self._storage / "refs" / self.revision
        if self.revision != self.commit and not (ref.is_file() and ref.read_text() == self.commit):
            ref.parent.mkdir(parents=True, exist_ok=True)
            ref.write_text(self.commit)

    def _verify(self, file: str, path: Path, sha256: str) -> None:
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(HASH_CHUNK_BYTES):
                digest.update(chunk)
        if digest.hexdigest() != sha256:
            blob = path.resolve()
            path.unlink(missing_ok=True)
            blob.unlink(missing_ok=True)
            raise ChecksumMismatchError(
                f"{self.description}: {file} downloaded with sha256 {digest.hexdigest()}, the Hub says {sha256}; "
                "the cached copy was deleted"
            )

    # --- internals -------------------------------------------------------------------------------

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

    def _read_remote(self, file: str, offset: int, out: memoryview) -> None:
        url = f"{self.endpoint}/{self.repo_id}/resolve/{self.commit}/{quote(file)}"
        headers = build_hf_headers(token=self._token, library_name="otfload")
        headers["Accept-Encoding"] = "identity"  # byte ranges of the stored bytes, not of a compressed body
        done = 0  # bytes already in ``out``: a retry resumes after them

        def attempt() -> None:
            nonlocal done
            headers["Range"] = f"bytes={offset + done}-{offset + len(out) - 1}"
            with get_session().stream("GET", url, headers=headers, timeout=self._retry.attempt_timeout_s) as r:
                if r.status_code not in (200, 206):
                    r.read()
                    hf_raise_for_status(r)
                if r.status_code == 200 and offset + done != 0:
                    raise SourceError(f"{self.description}: the server ignored the Range header for {file}")
                for chunk in r.iter_bytes():  # as received: a broken body still keeps what arrived
                    n = min(len(chunk), len(out) - done)
                    out[done : done + n] = chunk[:n]
                    done += n
                    if done == len(out):
                        return
            raise TransientError(f"response body ended after {done} of {len(out)} bytes")

        self._call(attempt, file)


    @contextmanager
    def _translated(self, file: str | None) -> Iterator[None]:
        """Turn ``huggingface_hub``/HTTP errors into otfload errors (permanent) or TransientError."""
        what = f"{self.description}: {file}" if file else self.description
        try:
            yield
        except OtfloadError:
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
            raise SourceError(f"{what}: HTTP {status}") from e
        except httpx2.TransportError as e:
            raise TransientError(f"{type(e).__name__}: {e}") from e
