"""The distributed shard cache: each checkpoint file fetched from the source once, cluster-wide.

Constructing a :class:`ShardCache` is collective: every process of the job does it, in the same
order. The files are split among the processes by :func:`~otfload.cache.assign.assign_files`; each
process makes sure its files are committed in the cache (reusing copies already there when their
size, and sha256 where the source publishes one, match; else fetching them whole from the source),
publishes each file's status, and then waits until every other file is committed. From then on the
cache is a :class:`~otfload.sources.base.Source` over the cached copies, so each process reads only
the byte ranges its own devices need, from the cache rather than from the source.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed

from otfload.cache.assign import assign_files
from otfload.cache.coordination import Coordinator, current_coordinator
from otfload.cache.store import Store, open_store, record_sha256, recorded_sha256
from otfload.errors import CacheFillError, CacheTimeoutError, ChecksumMismatchError
from otfload.sources.base import RangeRead, Source

# A process that owns a file waits on the source, the others on it: long enough for a multi-GB
# shard over a slow link, short enough that a dead peer is reported within minutes.
DEFAULT_TIMEOUT_S = 1800.0
# Files fetched at once by one process, and bytes of one file in memory at once (read in parallel
# pieces by the source's read_many, then written in order): ~4 × 256 MiB of buffers at most.
FILL_THREADS = 4
FILL_WINDOW_BYTES = 256 << 20

_fills = itertools.count()  # one per ShardCache in this process: the same sequence in every process


def cache_key(source: Source) -> str:
    """The cache folder of ``source``: readable, and distinct per source and pinned commit."""
    identity = f"{source.description}@{getattr(source, 'commit', '')}"
    slug = re.sub(r"[^\w.-]+", "-", source.description).strip("-")[:64]
    return f"{slug}-{hashlib.sha1(identity.encode()).hexdigest()[:12]}"


def published_sha256(source: Source, file: str) -> str | None:
    """The sha256 the source publishes for ``file`` (the Hub's LFS oid), if any."""
    sha256 = getattr(source, "sha256", None)
    return sha256(file) if callable(sha256) else None


class ShardCache:
    """``source``'s files, each fetched once by one process into ``cache_dir``, read from there.

    ``cache_dir`` is a directory all processes share or an fsspec URL (``gs://bucket/prefix``, with
    ``storage_options`` for the filesystem); the files go to a sub-folder named by
    :func:`cache_key`. ``coordinator`` defaults to JAX's distributed store when several processes
    run, else a local one. A process that waits more than ``timeout_s`` for another one's file
    raises :class:`~otfload.errors.CacheTimeoutError`; one whose peer failed to fetch a file raises
    :class:`~otfload.errors.CacheFillError`. ``fetched`` / ``reused`` list this process's files.
    """

    def __init__(
        self,
        source: Source,
        cache_dir: str | os.PathLike,
        *,
        storage_options: dict | None = None,
        coordinator: Coordinator | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        window_bytes: int = FILL_WINDOW_BYTES,
    ):
        self.source = source
        self.timeout_s = timeout_s
        self.window_bytes = window_bytes
        self.key = cache_key(source)
        self.store: Store = open_store(f"{os.fspath(cache_dir).rstrip('/')}/{self.key}", storage_options)
        self.coordinator = coordinator or current_coordinator()
        self._sizes = {f: source.size(f) for f in source.list_files()}
        self.fetched: list[str] = []
        self.reused: list[str] = []
        self._fill()
        self._cache = self.store.source()

    # --- the Source protocol ---------------------------------------------------------------------

    @property
    def description(self) -> str:
        return f"{self.source.description} (cached in {self.store.description})"

    def list_files(self) -> list[str]:
        return sorted(self._sizes)

    def size(self, file: str) -> int:
        return self.source.size(file)

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        self._cache.read_into(file, offset, out)

    def read_many(self, reads: Sequence[RangeRead]) -> None:
        self._cache.read_many(reads)

    def close(self) -> None:
        self._cache.close()
        self.source.close()

    def __repr__(self) -> str:
        return f"ShardCache({self.source!r}, {self.store.description!r})"

    # --- filling ---------------------------------------------------------------------------------

    def _fill(self) -> None:
        """Commit this process's files, publish each one's status, then wait for everyone else's."""
        me = self.coordinator.process_index
        owners = assign_files(self._sizes, self.coordinator.process_count)
        prefix = f"otfload/shard_cache/{next(_fills)}/{self.key}"
        mine = [f for f, owner in owners.items() if owner == me]
        failure: BaseException | None = None
        with ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="otfload-cache") as pool:
            futures = {pool.submit(self._ensure, f): f for f in mine}
            for future in as_completed(futures):
                if future.cancelled():  # after a failure: tell the peers at once rather than let them time out
                    status = f"error: not fetched, after {type(failure).__name__}: {failure}"
                elif (error := future.exception()) is not None:
                    status = f"error: {type(error).__name__}: {error}"
                    if failure is None:
                        failure = error
                        for other in futures:
                            other.cancel()
                else:
                    status = "ok"
                self.coordinator.publish(f"{prefix}/{futures[future]}", status)
        if failure is not None:
            raise failure
        deadline = time.monotonic() + self.timeout_s
        for file, owner in owners.items():
            if owner == me:
                continue
            status = self.coordinator.wait_for(f"{prefix}/{file}", deadline - time.monotonic())
            if status is None:
                raise CacheTimeoutError(
                    f"process {me} waited {self.timeout_s:g}s for process {owner} to commit {file!r} to "
                    f"{self.store.description}; is process {owner} alive? (raise timeout_s for slow sources)",
                    owner, file, me,
                )  # fmt: skip
            if status != "ok":
                raise CacheFillError(f"process {owner} could not cache {file!r} from {self.source.description}: "
                                     f"{status.removeprefix('error: ')}", owner, file)  # fmt: skip

    def _ensure(self, file: str) -> None:
        """Make sure a verified copy of ``file`` is committed: reuse it, or fetch it again."""
        sha256 = published_sha256(self.source, file)
        if self._is_valid(file, sha256):
            self.reused.append(file)
            return
        self.store.remove(file)
        self._fetch(file, sha256)
        if sha256 is not None:
            record_sha256(self.store, file, sha256)
        self.fetched.append(file)

    def _is_valid(self, file: str, sha256: str | None) -> bool:
        if self.store.committed_size(file) != self._sizes[file]:
            return False
        if sha256 is None:
            return True
        recorded = recorded_sha256(self.store, file)
        if recorded is None and self.store.sha256(file) == sha256:  # committed by an older run
            record_sha256(self.store, file, sha256)
            return True
        return recorded == sha256

    def _fetch(self, file: str, sha256: str | None) -> None:
        """Stream ``file`` from the source into the store, window by window; commit if it verifies."""
        size, digest = self._sizes[file], hashlib.sha256()
        with self.store.writer(file) as out:
            for start in range(0, size, self.window_bytes):
                window = bytearray(min(self.window_bytes, size - start))
                self.source.read_many([RangeRead(file, start, memoryview(window))])
                digest.update(window)
                out.write(window)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ChecksumMismatchError(
                    f"{self.source.description}: {file} fetched with sha256 {digest.hexdigest()}, "
                    f"the source says {sha256}; not cached"
                )
