"""Counting what a load really fetched from its storage: bytes and requests, gaps and pages included.

Sources record their own fetches with :func:`fetching` (an HTTP request, a ``preadv``, a prefetched
page range); a reader wraps what it asks of a source in :func:`expected_fetch`, which counts the
read as asked when the source records nothing. Counts go to the :class:`FetchMeter` of the load
the code works for (:func:`metering`: a context variable, which the load's pool threads see through
``otfload.sources.load_context.submit``), and from a child meter to its parent too.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class FetchMeter:
    """Bytes and requests a load really fetched from its storage; shared by the load's threads.

    A child meter (``parent=``) adds everything it records to its parent as well.
    """

    def __init__(self, parent: FetchMeter | None = None):
        self.bytes = 0
        self.requests = 0
        self.parent = parent
        self._lock = threading.Lock()

    def add(self, nbytes: int, requests: int = 1) -> None:
        """Count ``nbytes`` fetched in ``requests`` requests (here and in the parent meter)."""
        with self._lock:
            self.bytes += nbytes
            self.requests += requests
        if self.parent is not None:
            self.parent.add(nbytes, requests)


# The meter of the load the running code works for: one value per context (see current_meter).
_METER: contextvars.ContextVar[FetchMeter | None] = contextvars.ContextVar("otfload_fetch_meter", default=None)
# .inside: this thread is within a recorded fetch -- a fact of the thread's own call stack, not of
# its load, so work it hands to other threads starts outside one.
_fetching = threading.local()


def current_meter() -> FetchMeter | None:
    """The meter of the load this code works for, if any."""
    return _METER.get()


@contextmanager
def metering(meter: FetchMeter | None) -> Iterator[FetchMeter | None]:
    """Make ``meter`` the :func:`current_meter` of this context for the duration of the block."""
    previous, inside = _METER.set(meter), getattr(_fetching, "inside", False)
    _fetching.inside = False
    try:
        yield meter
    finally:
        _METER.reset(previous)
        _fetching.inside = inside


@contextmanager
def fetching(nbytes: int, requests: int = 1) -> Iterator[None]:
    """Record one fetch of ``nbytes`` from storage (a request, a ``preadv``, a prefetched range).

    Fetches made inside it (a remote source reading its own local copy) are not counted again.
    """
    meter = current_meter()
    if meter is None or getattr(_fetching, "inside", False):
        yield
        return
    meter.add(nbytes, requests)
    _fetching.inside = True
    try:
        yield
    finally:
        _fetching.inside = False


@contextmanager
def expected_fetch(nbytes: int, requests: int = 1) -> Iterator[None]:
    """A read about to be asked of a source: counted as ``nbytes`` in ``requests`` requests unless
    the source records its own fetches (then those count: coalesced runs, retries' requests)."""
    meter = current_meter()
    if meter is None or getattr(_fetching, "inside", False):
        yield
        return
    child = FetchMeter(parent=meter)
    previous = _METER.set(child)
    try:
        yield
    finally:
        _METER.reset(previous)
    if child.requests == 0:
        meter.add(nbytes, requests)
