"""Where checkpoint bytes come from: local directories, Hub repos and fsspec URLs (``gs://`` ...)."""

from __future__ import annotations

import os
from typing import Any

from otfload.sources.base import RangeRead, Source, read_bytes
from otfload.sources.checkpoint_files import check_safe_format
from otfload.sources.local import LocalSource
from otfload.sources.location import Kind, classify_location

__all__ = ["LocalSource", "RangeRead", "Source", "open_source", "read_bytes"]

_HUB_OPTIONS = ("revision", "token", "endpoint", "cache_dir", "local_files_only", "retry", "timeout")
_OPTIONS = {*_HUB_OPTIONS, "storage_options", "mmap"}


def open_source(location: str | os.PathLike[str] | Source, **options: Any) -> Source:
    """Open ``location`` as a :class:`Source`.

    - a :class:`Source`: returned as is;
    - ``scheme://...`` (``gs://``, ``s3://``, ``hf://``, ``memory://``, ``file://``, ...): an
      :class:`~otfload.sources.fsspec_source.FsspecSource` with ``options["storage_options"]``;
    - an existing local directory: a :class:`LocalSource`;
    - ``org/name`` that is not a local path: a :class:`~otfload.sources.hub.HubSource`, with the
      ``revision``, ``token``, ``endpoint``, ``cache_dir`` and ``local_files_only`` options.

    A location with pickle checkpoints but no safetensors raises ``UnsafeFormatError``. A local file,
    or a path that does not exist, raises ``SourceNotFoundError`` at once, naming the nearest existing
    parent (:mod:`otfload.sources.location` says how a path is told from a repo id). ``retry`` (a
    ``RetryPolicy``) applies to remote sources, and ``timeout`` (seconds; default the
    ``OTFLOAD_TIMEOUT`` environment variable, else no limit) is the total deadline of every remote
    read through the source, counted from its opening: past it a read raises ``SourceTimeoutError``
    naming the URL and the bytes received.
    ``mmap=False`` makes a local directory use ``preadv`` instead of a read-only mapping.
    Unknown options raise ``TypeError`` (a misspelt ``revison=`` must not be silently ignored).
    """
    unknown = set(options) - _OPTIONS
    if unknown:
        raise TypeError(f"unknown source option(s) {sorted(unknown)}; expected some of {sorted(_OPTIONS)}")
    if isinstance(location, Source):
        return location
    text = os.fspath(location)
    kind = classify_location(text)
    if kind is Kind.URL:
        from otfload.sources.fsspec_source import FsspecSource

        return FsspecSource(
            text, options.get("storage_options"), retry=options.get("retry"), timeout=options.get("timeout")
        )
    if kind is Kind.LOCAL:
        source = LocalSource(text, mmap=options.get("mmap", True))
        check_safe_format(source.list_files(), source.description)
        return source
    from otfload.sources.hub import HubSource

    return HubSource(text, **{k: options[k] for k in _HUB_OPTIONS if k in options})
