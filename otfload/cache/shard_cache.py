"""The distributed shard cache: each checkpoint file fetched from the source once, cluster-wide.

Constructing a :class:`ShardCache` is collective: every process of the job does it, in the same
order. The files are split among the processes by :func:`~otfload.coordination.assign_files`; each
process makes sure its files are committed in the cache (reusing copies whose record still matches,
see :mod:`otfload.cache.integrity`; else fetching them whole from the source, hashed as they stream),
publishes each file's status, and then waits until every other file is committed. From then on the
cache is a :class:`~otfload.sources.base.Source` over the cached copies, so each process reads only
the byte ranges its own devices need, from the cache rather than from the source.

Every listed name is checked before anything is written (:func:`~otfload.sources.names.checked_listing`
and :func:`~otfload.cache.store.check_cache_name`): a name that would leave the cache root is a
:class:`~otfload.errors.CacheUnsafeNameError` and nothing is created. A reused copy whose bytes no
longer match its record is fetched again (listed in ``repaired``); when that fetch fails too, the
error is a :class:`~otfload.errors.CacheIntegrityError` naming the file, never the changed bytes.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from otfload.accounting.gaps import DEFAULT_GAPS, GapPolicy
from otfload.cache.integrity import (
    VERIFY_FULL,
    VERIFY_MODES,
    VERIFY_RECORD,
    Hasher,
    Record,
    mismatches,
    published_digests,
)
from otfload.cache.store import EntryStat, Store, check_cache_name, open_store
from otfload.coordination import Coordinator, assign_files, current_coordinator
from otfload.errors import (
    CacheError,
    CacheFillError,
    CacheIntegrityError,
    CacheTimeoutError,
    CacheUnsafeNameError,
    ChecksumMismatchError,
    SourceError,
)
from otfload.sources.base import PinnedSource, RangeRead, Source, read_many
from otfload.sources.load_context import submit
from otfload.sources.names import checked_listing

log = logging.getLogger(__name__)

# A process that owns a file waits on the source, the others on it: long enough for a multi-GB
# shard over a slow link, short enough that a dead peer is reported within minutes.
DEFAULT_TIMEOUT_S = 1800.0
# Files fetched at once by one process, and bytes of one file in memory at once (read in parallel
# pieces by the source's read_many, then written in order): ~4 × 256 MiB of buffers at most.
FILL_THREADS = 4
FILL_WINDOW_BYTES = 256 << 20
HASH_CHUNK_BYTES = 8 << 20  # re-hashing a cached copy: large reads, at hashing speed

_fills = itertools.count()  # one per ShardCache in this process: the same sequence in every process


def cache_key(source: Source) -> str:
    """The cache folder of ``source``: readable, and distinct per source and pinned commit."""
    identity = f"{source.description}@{source.commit if isinstance(source, PinnedSource) else ''}"
    slug = re.sub(r"[^\w.-]+", "-", source.description).strip("-")[:64]
    return f"{slug}-{hashlib.sha1(identity.encode()).hexdigest()[:12]}"


class ShardCache:
    """``source``'s files, each fetched once by one process into ``cache_dir``, read from there.

    ``cache_dir`` is a directory all processes share or an fsspec URL (``gs://bucket/prefix``, with
    ``storage_options`` for the filesystem); the files go to a sub-folder named by
    :func:`cache_key`. ``coordinator`` defaults to JAX's distributed store when several processes
    run, else a local one. A process that waits more than ``timeout_s`` for another one's file
    raises :class:`~otfload.errors.CacheTimeoutError`; one whose peer failed to fetch a file raises
    :class:`~otfload.errors.CacheFillError`. ``verify`` is how a copy already in the cache is
    checked before it is reused: ``"record"`` (size, record and stamp; the copy is hashed again
    only when its stamp moved) or ``"full"`` (hashed again every time). ``fetched`` / ``reused``
    list this process's files, ``repaired`` those of them whose cached bytes had changed and were
    fetched again, ``orphans_removed`` the temporaries of dead writers it deleted. ``close()``
    closes the cache and, when ``owns_source`` (the default), ``source`` too; a load wrapping a
    source its caller passed in leaves that one open (:mod:`otfload.sources.owned`).
    """

    def __init__(
        self,
        source: Source,
        cache_dir: str | os.PathLike[str],
        *,
        storage_options: dict[str, Any] | None = None,
        coordinator: Coordinator | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        window_bytes: int = FILL_WINDOW_BYTES,
        verify: str = VERIFY_RECORD,
        owns_source: bool = True,
    ):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify={verify!r}: expected one of {', '.join(map(repr, VERIFY_MODES))}")
        self.source = source
        self.owns_source = owns_source
        self.timeout_s = timeout_s
        self.window_bytes = window_bytes
        self.verify = verify
        self.key = cache_key(source)
        # Every name is checked before the store creates anything.
        names = checked_listing(source.list_files(), source.description, CacheUnsafeNameError)
        self._sizes = {check_cache_name(f, source.description): source.size(f) for f in names}
        self.store: Store = open_store(cache_dir, self.key, storage_options)
        self.coordinator = coordinator or current_coordinator()
        self.fetched: list[str] = []
        self.reused: list[str] = []
        self.repaired: list[str] = []
        self.orphans_removed: list[str] = []
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

    def read_many(self, reads: Sequence[RangeRead], gaps: GapPolicy = DEFAULT_GAPS) -> None:
        read_many(self._cache, reads, gaps)

    def close(self) -> None:
        self._cache.close()
        if self.owns_source:
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
        self.orphans_removed = self.store.clean_orphans()
        if self.orphans_removed:
            log.info("removed %d temporaries of dead cache writers: %s", len(self.orphans_removed),
                     ", ".join(self.orphans_removed))  # fmt: skip
        failure: BaseException | None = None
        with ThreadPoolExecutor(FILL_THREADS, thread_name_prefix="otfload-cache") as pool:
            futures = {submit(pool, self._ensure, f): f for f in mine}  # in the load's context: its token, meter
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
            answer = self.coordinator.wait_for(f"{prefix}/{file}", deadline - time.monotonic())
            if answer is None:
                raise CacheTimeoutError(
                    f"process {me} waited {self.timeout_s:g}s for process {owner} to commit {file!r} to "
                    f"{self.store.description}; is process {owner} alive? (raise timeout_s for slow sources)",
                    owner, file, me,
                )  # fmt: skip
            if answer != "ok":
                raise CacheFillError(f"process {owner} could not cache {file!r} from {self.source.description}: "
                                     f"{answer.removeprefix('error: ')}", owner, file)  # fmt: skip

    def _ensure(self, file: str) -> None:
        """Make sure a verified copy of ``file`` is committed: reuse it, or fetch it (again)."""
        published = published_digests(self.source, file)
        trusted, changed = self._check(file, published)
        if trusted:
            self.reused.append(file)
            return
        self.store.remove(file)
        try:
            self._fetch(file, published)
        except SourceError as e:
            if changed is None or isinstance(e, CacheError):
                raise
            raise CacheIntegrityError(
                f"{self.store.path(file)}: {changed}, and fetching it again from {self.source.description} "
                f"failed ({type(e).__name__}: {e}); the changed copy was removed"
            ) from e
        if changed is not None:
            log.warning("%s: %s; fetched it again from %s", self.store.path(file), changed, self.source.description)
            self.repaired.append(file)
        self.fetched.append(file)

    def _revision(self) -> str | None:
        return (self.source.commit or None) if isinstance(self.source, PinnedSource) else None

    def _check(self, file: str, published: dict[str, str]) -> tuple[bool, str | None]:
        """``(trusted, why not)``: whether the committed copy of ``file`` may be reused; when a copy
        with a valid record no longer matches it, what changed (an integrity failure, not a miss)."""
        size, entry = self._sizes[file], self.store.stat(file)
        if entry is None:
            return False, None
        record = Record.loads(self.store.read_record(file))
        if record is None or not record.describes(size, self._revision(), published):
            # No usable record (an older otfload, or killed between commit and record): adopt the copy
            # only if its bytes are those the source publishes digests for.
            if entry.size == size and published:
                found = self._hash(file, published)
                if not mismatches(found, published):
                    self._record(file, found, published, entry, best_effort=True)
                    return True, None
            return False, None
        if entry.size != size:
            return False, f"its size changed from {size} to {entry.size} bytes since it was filled"
        if self.verify == VERIFY_FULL or not record.stamp or record.stamp != entry.stamp:
            found = self._hash(file, published)
            if found["sha256"] != record.sha256 or mismatches(found, published):
                return False, (f"its bytes changed since it was filled (sha256 {found['sha256']}, "
                               f"recorded {record.sha256})")  # fmt: skip
            if record.stamp != entry.stamp:
                self._record(file, found, published, entry, best_effort=True)
        return True, None

    def _hash(self, file: str, published: dict[str, str]) -> dict[str, str]:
        hasher = Hasher(published)
        with self.store.reader(file) as f:
            try:
                while chunk := f.read(HASH_CHUNK_BYTES):
                    hasher.update(chunk)
            except OSError as e:
                raise CacheIntegrityError(f"{self.store.path(file)}: cannot be read back ({e})") from e
        return hasher.digests()

    def _record(
        self,
        file: str,
        found: dict[str, str],
        published: dict[str, str],
        entry: EntryStat | None,
        best_effort: bool = False,
    ) -> None:
        """Write the record of the committed ``file`` (best effort: a read-only cache still serves reads)."""
        entry = entry or self.store.stat(file)
        if entry is None:
            raise CacheError(f"{self.store.path(file)} vanished right after it was committed")
        record = Record(entry.size, found["sha256"], self._revision(), dict(published), entry.stamp)
        try:
            self.store.write_record(file, record.dumps())
        except CacheError:
            if not best_effort:
                raise

    def _fetch(self, file: str, published: dict[str, str]) -> None:
        """Stream ``file`` from the source into the store window by window, hashing it on the way;
        commit it only if it matches every digest the source publishes, then record it."""
        size, hasher = self._sizes[file], Hasher(published)
        with self.store.writer(file) as out:
            for start in range(0, size, self.window_bytes):
                window = bytearray(min(self.window_bytes, size - start))
                self.source.read_many([RangeRead(file, start, memoryview(window))])
                hasher.update(window)
                out.write(window)
            found = hasher.digests()
            if bad := mismatches(found, published):
                raise ChecksumMismatchError(
                    f"{self.source.description}: {file} fetched with {'; '.join(bad)} (the source's); not cached"
                )
        self._record(file, found, published, None)
