"""Range GETs over urllib3, each body read straight into the caller's buffer, a piece at a time.

``huggingface_hub``'s httpx client hands a body out in 64 KiB pieces through h11's parser and a
stack of generators, each piece a new bytes object copied on into the buffer. Measured on loopback
(8 threads reading 6 MiB ranges of one file from the local Hub server): ``HubSource`` reads took
**6.3 CPU-s per GB** through httpx and **1.7-2.6** through this module (the rest is the source's
own per-request work); urllib3's reads alone cost 0.7-1.0 (``http.client``'s ``readinto`` alone
0.8): the socket is read (the GIL released while it waits) a piece at a time, straight into the
destination (:func:`body_reader`).
On a 2-core machine the HTTP client, not the network, had set a Hub load's speed.

What httpx did for the Hub and this module keeps: connections kept alive and shared by a source's
threads (one pool per proxy, closed with the source); redirects followed (the Hub's ``resolve``
answers 302 to its CDN), dropping ``Authorization`` when the host changes; proxies from the
environment (``HTTP(S)_PROXY``, ``ALL_PROXY``, ``NO_PROXY``); CA certificates from
``SSL_CERT_FILE``/``SSL_CERT_DIR`` when set, else certifi's bundle, as httpx. No retries here: the
caller's retry policy owns them, so every error is raised as it happens (connection errors wrapped
in ``MaxRetryError``, whose ``reason`` says what).
"""

from __future__ import annotations

import http.client
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any
from urllib.parse import urlsplit

import certifi
import urllib3
from urllib3.util import Retry, Timeout

# Bytes per ``readinto`` call (see :func:`body_reader`): larger pieces mean fewer calls (through
# urllib3's read: 64 KiB pieces 1.2 CPU-s/GB, 1 MiB 0.9, 8 MiB 0.95 and 8 MiB of transient memory per
# request). A body that ends early hands over what arrived; one whose connection breaks with an
# error mid-piece loses that piece, so a retry asks again for less than this many bytes. ``read1``
# would keep them but returns one socket read per call: 0.80-1.07 CPU-s/GB against 0.65-0.70 on
# loopback (8 threads, 1 MiB pieces), for a failure that costs < 1 MiB.
BODY_PIECE_BYTES = 1 << 20
# Redirects followed per request: httpx's default, which ``huggingface_hub`` used.
MAX_REDIRECTS = 20
# Connections kept per host: above a source's requests in flight (``MAX_REQUESTS_IN_FLIGHT`` = 16),
# with room for a subclass that allows more, so none is closed after its answer and re-opened.
CONNECTIONS_PER_HOST = 64
# Bytes of an error answer's body kept for its message.
ERROR_BODY_BYTES = 64 << 10

_NO_RETRIES = Retry(total=None, connect=0, read=0, status=0, other=0, redirect=MAX_REDIRECTS,
                    raise_on_redirect=True, raise_on_status=False, respect_retry_after_header=False)  # fmt: skip


def _ca_options() -> tuple[str | None, str | None]:
    """(``ca_certs``, ``ca_cert_dir``): the environment's, else certifi's bundle."""
    cert_file, cert_dir = os.environ.get("SSL_CERT_FILE") or None, os.environ.get("SSL_CERT_DIR") or None
    return (cert_file, cert_dir) if cert_file or cert_dir else (certifi.where(), None)


def _proxy_for(url: str) -> str | None:
    """The environment's proxy for ``url`` (``NO_PROXY`` honoured), or None."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass(parts.hostname or ""):
        return None
    return proxy


class Connections:
    """The kept-alive connections of one source: a pool per proxy, shared by its threads.

    Connections stay open between requests until :meth:`close` (a source's own ``close``).
    """

    def __init__(self) -> None:
        self._pools: dict[str | None, urllib3.PoolManager] = {}
        self._lock = threading.Lock()

    def pool_for(self, url: str) -> urllib3.PoolManager:
        """The pool that reaches ``url`` (through the environment's proxy, if any)."""
        proxy = _proxy_for(url)
        with self._lock:
            pool = self._pools.get(proxy)
            if pool is None:
                ca_certs, ca_cert_dir = _ca_options()
                pool = (
                    urllib3.ProxyManager(proxy, retries=_NO_RETRIES, maxsize=CONNECTIONS_PER_HOST, ca_certs=ca_certs,
                                         ca_cert_dir=ca_cert_dir)
                    if proxy
                    else urllib3.PoolManager(retries=_NO_RETRIES, maxsize=CONNECTIONS_PER_HOST, ca_certs=ca_certs,
                                             ca_cert_dir=ca_cert_dir)
                )  # fmt: skip
                self._pools[proxy] = pool
            return pool

    @contextmanager
    def get(self, url: str, headers: dict[str, str], idle_s: float) -> Iterator[urllib3.BaseHTTPResponse]:
        """GET ``url`` with its body left unread; every wait (connect, headers, each piece) is bounded
        by ``idle_s``. urllib3 returns the connection to the pool once the body has been read to its
        end (or closes it on an error); a body left unread closes it here, so that no later answer
        on that connection starts with this one's bytes."""
        response = self.pool_for(url).urlopen(
            "GET", url, headers=headers, preload_content=False, decode_content=False,
            timeout=Timeout(connect=idle_s, read=idle_s),
        )  # fmt: skip
        try:
            yield response
        finally:
            if response.connection is not None:  # still held by this response
                if not _read_to_end(response):  # read to its end by body_reader (past urllib3): reusable
                    response.close()
                response.release_conn()

    def close(self) -> None:
        """Close every idle connection; one still answering is closed when its request ends."""
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.clear()


def body_reader(response: urllib3.BaseHTTPResponse) -> Callable[[memoryview], int]:
    """``readinto`` for ``response``'s body, straight from the socket into the caller's buffer.

    urllib3's own ``readinto`` reads each piece into a new bytes object and copies it over: a
    second copy of every byte, and a fresh 1 MiB allocation per piece (glibc maps and unmaps such
    blocks, so their pages are faulted in anew each time). The ``http.client`` response under it
    reads into the buffer itself; its errors are raised as urllib3's would be (a timeout as
    ``ReadTimeoutError``, a broken connection or a body shorter than its ``Content-Length`` as
    ``ProtocolError``). The body is not decoded either way (``decode_content=False``). Another
    response type keeps its own ``readinto``. Measured on the shaped Hub benchmark (556 MB,
    docs/benchmarks_remote.md): 12 K fewer page faults and 0.3-0.6 client CPU-s less."""
    raw = _raw(response)
    if raw is None:
        return response.readinto
    pool: Any = getattr(response, "_pool", None)  # what urllib3 names in its own timeout errors

    def readinto(out: memoryview) -> int:
        try:
            got = raw.readinto(out)
        except TimeoutError as e:
            raise urllib3.exceptions.ReadTimeoutError(pool, None, f"Read timed out. ({e})") from e
        except (http.client.HTTPException, OSError) as e:
            raise urllib3.exceptions.ProtocolError(f"Connection broken: {e!r}", e) from e
        if got == 0 and len(out) and raw.length:  # the connection ended before Content-Length said
            short = http.client.IncompleteRead(b"", raw.length)
            raise urllib3.exceptions.ProtocolError(f"Connection broken: {short!r}", short)
        return got

    return readinto


def _raw(response: urllib3.BaseHTTPResponse) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under urllib3's, if that is what it wraps."""
    raw = getattr(response, "_fp", None)
    return raw if isinstance(raw, http.client.HTTPResponse) else None


def _read_to_end(response: urllib3.BaseHTTPResponse) -> bool:
    """Whether ``http.client`` read ``response``'s whole body (it closes itself then, length 0)."""
    raw = _raw(response)
    return raw is not None and raw.isclosed() and raw.length == 0


def socket_of(response: urllib3.BaseHTTPResponse) -> socket.socket | None:
    """The socket ``response``'s body arrives on (to cut a dripping body from another thread)."""
    connection = response.connection
    sock = getattr(connection, "sock", None)
    return sock if isinstance(sock, socket.socket) else None


def shutdown(sock: socket.socket | None) -> None:
    """Unblock a thread reading ``sock`` (it sees the connection end); the pool then drops it."""
    if sock is not None:
        with suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def error_body(response: urllib3.BaseHTTPResponse) -> bytes:
    """At most :data:`ERROR_BODY_BYTES` of an error answer's body, for its message."""
    return response.read(ERROR_BODY_BYTES)
