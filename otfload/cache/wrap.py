"""Choosing how a load reaches a remote source: direct range reads, or through a shard cache."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from otfload.cache.integrity import VERIFY_FULL, VERIFY_MODES, VERIFY_RECORD, Hasher, mismatches, published_digests
from otfload.cache.shard_cache import HASH_CHUNK_BYTES, ShardCache
from otfload.errors import CacheError, CacheIntegrityError
from otfload.sources.base import DownloadableSource, Source
from otfload.sources.local import LocalSource


def default_cache_dir() -> Path:
    """Where ``cache_dir=True`` keeps whole files of a source that keeps none itself, unless its
    caller names a directory (a load's options do: ``$OTFLOAD_CACHE``, :mod:`otfload.options.environment`)."""
    return Path("~/.cache/otfload").expanduser()


def wrap_with_cache(
    source: Source,
    cache_dir: str | os.PathLike[str] | bool | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    verify: str = VERIFY_RECORD,
    owns_source: bool = True,
    local_dir: str | os.PathLike[str] | None = None,
    **options: Any,
) -> Source:
    """The source a load should read from.

    - ``cache_dir`` None/False, or a local source: ``source`` itself; each process reads only its
      byte ranges straight from the source.
    - ``cache_dir=True`` (one process only): whole files cached on this host, in the HF cache for
      a Hub source (``source.download``), else in :func:`default_cache_dir`.
    - a directory shared by the processes, or an fsspec URL (``gs://bucket/prefix`` with
      ``storage_options``): a :class:`ShardCache` there; ``options`` go to it. Collective when
      several processes run: every process must call it.

    ``verify`` (``"record"`` or ``"full"``) is how cached copies are checked before reuse (see
    :class:`ShardCache`); with ``cache_dir=True`` and a Hub source, ``"full"`` re-hashes every file
    the Hub publishes a sha256 for and raises :class:`~otfload.errors.CacheIntegrityError` on a mismatch.
    ``owns_source=False`` (``source`` is the caller's): closing the cache leaves ``source`` open.
    """
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: expected one of {', '.join(map(repr, VERIFY_MODES))}")
    if cache_dir is None or cache_dir is False or isinstance(source, LocalSource):
        return source
    if cache_dir is True:
        import jax

        if jax.process_count() > 1:
            raise CacheError(
                f"cache_dir=True caches on one host, but {jax.process_count()} processes are loading "
                f"{source.description}: name a directory they all share or a gs:// prefix"
            )
        if isinstance(source, DownloadableSource):
            for file in source.list_files():
                path = source.download(file)
                if verify == VERIFY_FULL:
                    _check_download(source, file, path)
            return source
        cache_dir = default_cache_dir() if local_dir is None else local_dir
    return ShardCache(source, cache_dir, storage_options=storage_options, verify=verify, owns_source=owns_source,
                      **options)


def _check_download(source: Source, file: str, path: str | os.PathLike[str]) -> None:
    """Re-hash a whole-file copy the source keeps itself (the HF cache) against its published digests."""
    published = published_digests(source, file)
    if not published:
        return
    hasher = Hasher(published)
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            hasher.update(chunk)
    if bad := mismatches(hasher.digests(), published):
        raise CacheIntegrityError(f"{path} (the cached copy of {file} from {source.description}) has changed: "
                                  f"{'; '.join(bad)}; delete it to fetch it again")  # fmt: skip
