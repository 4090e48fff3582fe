"""Counting what a load really fetched from its storage: bytes and requests, gaps and pages included.

Sources record their own fetches with :func:`fetching` (an HTTP request, a ``preadv``, a prefetched
page range); a reader wraps what it asks of a source in :func:`expected_fetch`, which counts the
read as asked when the source records nothing. Counts go to the :class:`FetchMeter` this thread
works for (:func:`metering`), and from a child meter to its parent too.
"""

from __future__ import annotations

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


_metering = threading.local()  # .meter: this thread's FetchMeter; .inside: within a recorded fetch


def current_meter() -> FetchMeter | None:
    """The meter of the load this thread works for, if any."""
    return getattr(_metering, "meter", None)


@contextmanager
def metering(meter: FetchMeter | None) -> Iterator[FetchMeter | None]:
    """Make ``meter`` this thread's :func:`current_meter` for the duration of the block."""
    previous, inside = current_meter(), getattr(_metering, "inside", False)
    _metering.meter, _metering.inside = meter, False
    try:
        yield meter
    finally:
        _metering.meter, _metering.inside = previous, inside


@contextmanager
def fetching(nbytes: int, requests: int = 1) -> Iterator[None]:
    """Record one fetch of ``nbytes`` from storage (a request, a ``preadv``, a prefetched range).

    Fetches made inside it (a remote source reading its own local copy) are not counted again.
    """
    meter = current_meter()
    if meter is None or getattr(_metering, "inside", False):
        yield
        return
    meter.add(nbytes, requests)
    _metering.inside = True
    try:
        yield
    finally:
        _metering.inside = False


@contextmanager
def expected_fetch(nbytes: int, requests: int = 1) -> Iterator[None]:
    """A read about to be asked of a source: counted as ``nbytes`` in ``requests`` requests unless
    the source records its own fetches (then those count: coalesced runs, retries' requests)."""
    meter = current_meter()
    if meter is None or getattr(_metering, "inside", False):
        yield
        return
    child = FetchMeter(parent=meter)
    _metering.meter = child
    try:
        yield
    finally:
        _metering.meter = meter
    if child.requests == 0:
        meter.add(nbytes, requests)
