"""Network shaping for the test servers: a bandwidth cap per answer and one shared by all answers.

A real network is not loopback: every request waits a round trip before its first byte, one TCP
stream is limited by its window and the path (a CDN edge or an object store serves ~50-100 MB/s per
connection), and the host's link caps everything together. The test servers model the round trip
with a per-request delay and the two caps with :class:`Link` (shared) and :func:`send_paced` (per
answer), so that concurrency matters as it does on a real network. Loopback itself is far faster than
either cap, so the caps, not the sockets, set the pace.
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator

# Bytes written per pacing step: small enough that a capped answer flows smoothly (at 50 MB/s a step
# is 5 ms, well under a 20 ms round trip), large enough that sleeping per step costs little CPU on a
# 2-core machine (~200 wake-ups per second per answer at 50 MB/s).
PACE_STEP_BYTES = 256 << 10


class Link:
    """A link of ``rate_bytes_s`` shared by every answer (None or 0: unlimited), first come first served.

    Each step reserves its transmission time on the link's clock and sleeps until it has passed, so
    the answers together never exceed the rate whatever their number.
    """

    def __init__(self, rate_bytes_s: float | None = None):
        self.rate_bytes_s = rate_bytes_s or 0.0
        self._free_at = 0.0  # monotonic time at which the link has sent everything reserved so far
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> None:
        """Block until ``nbytes`` more may go out."""
        if not self.rate_bytes_s:
            return
        with self._lock:
            now = time.monotonic()
            self._free_at = max(now, self._free_at) + nbytes / self.rate_bytes_s
            done_at = self._free_at
        time.sleep(max(0.0, done_at - time.monotonic()))


def send_paced(
    write: Callable[[bytes | bytearray | memoryview], object],
    data: bytes | bytearray | memoryview,
    rate_bytes_s: float = 0.0,
    link: Link | None = None,
) -> None:
    """``write(data)`` at most ``rate_bytes_s`` (0: unlimited) and within ``link``'s share, step by step."""
    view = memoryview(data)
    if not rate_bytes_s and (link is None or not link.rate_bytes_s):
        write(view)
        return
    start = time.monotonic()
    for pos in range(0, len(view), PACE_STEP_BYTES):
        step = view[pos : pos + PACE_STEP_BYTES]
        if link is not None:
            link.take(len(step))
        write(step)
        if rate_bytes_s:
            time.sleep(max(0.0, start + (pos + len(step)) / rate_bytes_s - time.monotonic()))


def client_gone(conn: socket.socket, wait_s: float) -> bool:
    """Wait up to ``wait_s`` on a server-side connection; True if its client closed its end meanwhile.
    ``poll``, not ``select``: a long test session holds more than 1024 descriptors, which ``select``
    cannot watch."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    if not poller.poll(wait_s * 1000):
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


# How long a GET held for ``faults.gather`` waits for the others before it is answered anyway.
GATHER_TIMEOUT_S = 10.0


class GetsInFlight:
    """Counts the GETs a test server is answering at once (``in_flight``, ``peak_in_flight``) and
    holds each until ``faults.gather`` have been in flight together (``gather_missed`` counts those
    that waited in vain). The server sets ``_flight`` (a Condition), the counters and ``faults``."""

    _flight: threading.Condition
    in_flight: int
    peak_in_flight: int
    gather_missed: int
    faults: object

    @contextlib.contextmanager
    def answering(self, counted: bool) -> Iterator[Callable[[], None]]:
        """Count a GET in flight while it is answered (``counted``: a matching one), after holding it
        until ``faults.gather`` of them have been in flight at once. Yields the function ending its
        time in flight (idempotent; called at the latest when the block ends)."""
        if not counted:
            yield lambda: None
            return
        with self._flight:
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            self._flight.notify_all()
            gather = self.faults.gather  # type: ignore[attr-defined]
            if gather and not self._flight.wait_for(lambda: self.peak_in_flight >= gather, GATHER_TIMEOUT_S):
                self.gather_missed += 1
        ended = False

        def end() -> None:
            nonlocal ended
            with self._flight:
                if not ended:
                    ended = True
                    self.in_flight -= 1

        try:
            yield end
        finally:
            end()
