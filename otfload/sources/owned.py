"""Who closes a source: the one rule every entry point follows.

A call given a location (a path, URL or Hub id) opens the source itself and must close it when it
is done, on success and on error alike. A call given a :class:`~otfload.sources.Source` borrows
it: the caller opened it, may use it again afterwards, and closes it itself. A source a call makes
*around* a borrowed one (a shard cache, a base with adapters) is the call's own: closing it
closes what it opened and leaves the borrowed source open.

The rule is therefore an identity test — a call owns the source it holds unless that source *is*
what it was given — and :func:`owned` applies it as a context manager.

The context managers are classes, not ``@contextmanager`` generators, so that the "close it on
error only" idiom is safe: ``on_error.enter_context(owned(src, given))`` then, once the call
succeeds, ``on_error.pop_all()`` hands ``src`` to the caller. A generator popped that way would
still close the source when it is garbage-collected (its ``finally`` runs on ``GeneratorExit``).
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

from otfload.sources.base import Source


def is_owned(source: Source, given: object) -> bool:
    """Whether a call given ``given`` (a location or a :class:`Source`) that now holds ``source``
    must close it: it opened (or wrapped) it itself, rather than being handed it."""
    return source is not given


class owned:  # noqa: N801 - a context manager used like a function: ``with owned(src, given):``
    """``source`` for the ``with`` block, closed on exit (error included) when :func:`is_owned`;
    a :class:`Source` the caller passed in (``given``) is left open. Nothing happens unless the
    block is exited: popped from an ``ExitStack`` and dropped, it closes nothing."""

    def __init__(self, source: Source, given: object) -> None:
        self.source = source
        self.given = given

    def __enter__(self) -> Source:
        return self.source

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        if is_owned(self.source, self.given):
            self.source.close()


def owned_source(location: str | os.PathLike[str] | Source, **options: Any) -> owned:
    """:func:`~otfload.sources.open_source` ``(location, **options)`` for the ``with`` block: closed
    on exit (error included) if it was opened here, left open if ``location`` was a :class:`Source`.
    The source is opened at this call (so an unknown option or a missing location fails here)."""
    from otfload.sources import open_source

    return owned(open_source(location, **options), location)
