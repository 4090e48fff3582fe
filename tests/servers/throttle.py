"""Network shaping for the test servers: a bandwidth cap per answer and one shared by all answers.

A real network is not loopback: every request waits a round trip before its first byte, one TCP
stream is limited by its window and the path (a CDN edge or an object store serves ~50-100 MB/s per
connection), and the host's link caps everything together. The test servers model the round trip
with a per-request delay and the two caps with :class:`Link` (shared) and :func:`send_paced` (per
answer), so that concurrency matters as it does on a real network. Loopback itself is far faster than
either cap, so the caps, not the sockets, set the pace.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable

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
