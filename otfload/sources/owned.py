"""Who closes a source: the one rule every entry point follows.

A call given a location (a path, URL or Hub id) opens the source itself and must close it when it
is done, on success and on error alike. A call given a :class:`~otfload.sources.Source` borrows
it: the caller opened it, may use it again afterwards, and closes it itself. A source a call makes
*around* a borrowed one (a shard cache, a base with adapters) is the call's own: closing it
closes what it opened and leaves the borrowed source open.

The rule is therefore an identity test — a call owns the source it holds unless that source *is*
what it was given — and :func:`owned` applies it as a context manager.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from otfload.sources.base import Source


def is_owned(source: Source, given: object) -> bool:
    """Whether a call given ``given`` (a location or a :class:`Source`) that now holds ``source``
    must close it: it opened (or wrapped) it itself, rather than being handed it."""
    return source is not given


@contextmanager
def owned(source: Source, given: object) -> Iterator[Source]:
    """``source`` for the ``with`` block, closed on exit (error included) when :func:`is_owned`;
    a :class:`Source` the caller passed in (``given``) is left open."""
    try:
        yield source
    finally:
        if is_owned(source, given):
            source.close()


@contextmanager
def owned_source(location: str | os.PathLike[str] | Source, **options: Any) -> Iterator[Source]:
    """:func:`~otfload.sources.open_source` ``(location, **options)`` for the ``with`` block: closed
    on exit (error included) if it was opened here, left open if ``location`` was a :class:`Source`."""
    from otfload.sources import open_source

    with owned(open_source(location, **options), location) as source:
        yield source
