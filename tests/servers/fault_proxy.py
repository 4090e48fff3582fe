"""A real HTTP reverse proxy on 127.0.0.1 that misbehaves on purpose, for servers we do not own.

Put it in front of the real fake-gcs-server (or any HTTP server) and point the client at
:attr:`FaultProxy.url`: every request is forwarded upstream over a real connection and the answer
relayed, except that requests whose path and query contain :attr:`ProxyFaults.match` may be
dripped (headers, then one byte every ``drip_interval_s``), stalled (half the body, then silence
with the connection open), failed with a 5xx, or have their ``Range`` shifted or dropped before
forwarding (so the upstream's own answer names other bytes, or is a ``200`` with the whole file).

It can also shape the network (issue 20) for every request: ``delay_s`` is a round trip paid before
each answer, ``rate_bytes_s`` caps each answer's body and ``link_bytes_s`` all bodies together (see
:mod:`tests.servers.throttle`); answers without a fault are streamed as they arrive from upstream, so
a capped answer is not held back whole. For matching requests (object reads) the proxy counts what
clients really fetched (:attr:`FaultProxy.body_bytes`), how many were in flight at once, and dripping
or stalled answers the client hung up on (:attr:`FaultProxy.abandoned`); ``gather`` holds them until
that many are in flight at once, a proof that a client sends them concurrently.
"""

from __future__ import annotations

import contextlib
import http.client
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple
from urllib.parse import urlsplit

from .throttle import GetsInFlight, Link, client_gone, send_paced

STALL_HOLD_S = 30.0  # a stalled answer keeps its connection open this long at most (or until the client leaves)
UPSTREAM_TIMEOUT_S = 30.0  # the upstream is a local test server: it answers in milliseconds
RELAY_CHUNK_BYTES = 1 << 20  # bytes read from upstream per step of a streamed answer
# ProxyFaults.gather: a matching GET waits at most this long for the others; a loaded 2-core machine
# starts a client's requests within milliseconds, so only one sending them one by one waits it out.
# Headers that describe one hop, not the message: never relayed (RFC 9110 section 7.6.1).
HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length"}
)


class ProxiedRequest(NamedTuple):
    """One request as the proxy saw it; ``fault`` is the fault applied, or ""."""

    method: str
    target: str
    range: str | None
    fault: str


@dataclass
class ProxyFaults:
    """Fault knobs; counters are consumed one per matching request."""

    match: str = "alt=media"  # apply faults only to requests whose target contains this (GCS object reads)
    drip_next: int = 0  # headers, then one body byte every ``drip_interval_s``
    drip_interval_s: float = 1.0
    stall_next: int = 0  # half the body, then silence with the connection kept open
    fail_next: int = 0  # answer ``fail_status`` without asking upstream
    fail_status: int = 503
    shift_range_next: int = 0  # forward ``Range`` one byte later: upstream answers for other bytes
    drop_range_next: int = 0  # forward without ``Range``: upstream answers 200 with the whole object
    # network shaping, for every request (not only matching ones):
    delay_s: float = 0.0  # sleep before answering (a round trip's latency)
    rate_bytes_s: float = 0.0  # cap on each answer's body (one TCP stream's share); 0: none
    link_bytes_s: float = 0.0  # cap on all answers' bodies together (the host's link); 0: none
    # matching GETs wait until this many have been in flight at once (FaultProxy.peak_in_flight); one
    # that waits GATHER_TIMEOUT_S in vain is relayed anyway and counted in FaultProxy.gather_missed
    gather: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _link: Link = field(default_factory=Link, repr=False)

    def take(self, knob: str) -> bool:
        """Consume one unit of counter ``knob`` if any is left."""
        with self.lock:
            left = getattr(self, knob)
            if left > 0:
                setattr(self, knob, left - 1)
            return left > 0

    def link(self) -> Link:
        """The link every answer shares, capped at the current ``link_bytes_s``."""
        self._link.rate_bytes_s = self.link_bytes_s
        return self._link


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    proxy: FaultProxy


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    # Ends the current GET's time in flight; called before its last body bytes are written, so a
    # client's next request (sent once it has them all) never overlaps it in FaultProxy.in_flight.
    _answered: Callable[[], None] = staticmethod(lambda: None)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - silence stderr access log
        pass

    def do_GET(self) -> None:
        with self.server.proxy.answering(self.server.proxy.faults.match in self.path) as self._answered:
            self._relay()

    def do_HEAD(self) -> None:
        self._relay()

    def do_POST(self) -> None:
        self._relay()

    def do_PUT(self) -> None:
        self._relay()

    def do_DELETE(self) -> None:
        self._relay()

    def do_PATCH(self) -> None:
        self._relay()

    def _relay(self) -> None:
        proxy = self.server.proxy
        faults = proxy.faults
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP and k.lower() != "host"}
        fault = ""
        if faults.match in self.path and self.command == "GET":
            for knob in ("fail_next", "drip_next", "stall_next", "shift_range_next", "drop_range_next"):
                if faults.take(knob):
                    fault = knob.removesuffix("_next")
                    break
        proxy.log.append(ProxiedRequest(self.command, self.path, self.headers.get("Range"), fault))
        if faults.delay_s:
            time.sleep(faults.delay_s)
        if fault == "fail":
            self._answer(faults.fail_status, {"Content-Type": "text/plain"}, b"injected failure")
            return
        if fault == "shift_range" and "Range" in headers:
            first, _, last = headers["Range"].removeprefix("bytes=").partition("-")
            headers["Range"] = f"bytes={int(first) + 1}-{int(last) + 1 if last else ''}"
        if fault == "drop_range":
            headers.pop("Range", None)
        if fault not in ("drip", "stall"):
            self._stream(headers, body, counted=faults.match in self.path)
            return
        status, reply_headers, data = proxy.forward(self.command, self.path, headers, body)
        if fault == "drip":
            self._answer(status, reply_headers, data, drip=faults.drip_interval_s)
        else:
            self._answer(status, reply_headers, data, stall=True)

    def _stream(self, headers: dict[str, str], body: bytes, counted: bool) -> None:
        """Relay upstream's answer as it arrives, within the rate caps; ``counted``: add its body to
        :attr:`FaultProxy.body_bytes`."""
        proxy, faults = self.server.proxy, self.server.proxy.faults
        conn = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            conn.request(self.command, self.path, body=body or None, headers=headers)
            r = conn.getresponse()
            length = r.getheader("Content-Length")
            if length is None or not length.isdigit():  # chunked upstream: relay it whole, with a length
                data = r.read()
                relayed = {k: v for k, v in r.getheaders() if k.lower() not in HOP_BY_HOP}
                self._answer(r.status, relayed, data, paced=True, counted=counted)
                return
            self.send_response(r.status)
            for k, v in r.getheaders():
                if k.lower() not in HOP_BY_HOP:
                    self.send_header(k, v)
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command == "HEAD":
                return
            left = int(length)
            try:
                while chunk := r.read(RELAY_CHUNK_BYTES):
                    left -= len(chunk)
                    if left <= 0:
                        self._answered()
                    send_paced(self.wfile.write, chunk, faults.rate_bytes_s, faults.link())
                    if counted:
                        proxy.count_body(len(chunk))
            except OSError:  # the client gave up
                self.close_connection = True
        finally:
            conn.close()

    def _answer(
        self,
        status: int,
        headers: dict[str, str],
        data: bytes,
        drip: float | None = None,
        stall: bool = False,
        paced: bool = False,
        counted: bool = False,
    ) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        try:
            if drip is not None:
                self.close_connection = True
                for i in range(len(data)):
                    self.wfile.write(data[i : i + 1])
                    self.wfile.flush()
                    if self._client_gone(drip):
                        self.server.proxy.count_abandoned()
                        return
            elif stall:
                self.close_connection = True
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                deadline = time.monotonic() + STALL_HOLD_S
                while time.monotonic() < deadline and self.server.proxy.running:
                    if self._client_gone(0.05):
                        self.server.proxy.count_abandoned()
                        return
            elif paced:
                self._answered()
                faults = self.server.proxy.faults
                send_paced(self.wfile.write, data, faults.rate_bytes_s, faults.link())
                if counted:
                    self.server.proxy.count_body(len(data))
            else:
                self.wfile.write(data)
        except OSError:  # the client gave up: what a drip or stall test wants
            self.close_connection = True
            if drip is not None or stall:
                self.server.proxy.count_abandoned()

    def _client_gone(self, wait_s: float) -> bool:
        """Wait up to ``wait_s``; True if the client closed its end meanwhile."""
        return client_gone(self.request, wait_s)


class FaultProxy(GetsInFlight):
    """A fault-injecting HTTP reverse proxy for ``upstream`` (``http://host:port``); a context manager.

    ``match`` picks the object reads that faults apply to and bodies are counted for (the
    :attr:`ProxyFaults.match` of every reset): GCS's ``alt=media`` by default, a bucket's path for S3.
    """

    def __init__(self, upstream: str, match: str = ProxyFaults.match):
        parts = urlsplit(upstream)
        self.upstream_host, self.upstream_port = parts.hostname or "127.0.0.1", parts.port or 80
        self.match = match
        self.faults = ProxyFaults(match=match)
        self.log: list[ProxiedRequest] = []
        self.body_bytes = 0  # body bytes relayed for requests matching ``faults.match``
        self._body_lock = threading.Lock()
        self.in_flight = 0  # matching GETs being answered now
        self.peak_in_flight = 0  # most matching GETs answered at once since the last reset
        self.gather_missed = 0  # matching GETs that waited for ProxyFaults.gather in vain
        self.abandoned = 0  # dripping or stalled answers whose client hung up before the proxy gave up
        self._flight = threading.Condition()
        self.port = 0
        self._httpd: _Server | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def forward(self, method: str, target: str, headers: dict[str, str], body: bytes) -> tuple[int, dict, bytes]:
        """Send one request upstream on a fresh connection; (status, relayable headers, body)."""
        conn = http.client.HTTPConnection(self.upstream_host, self.upstream_port, timeout=UPSTREAM_TIMEOUT_S)
        try:
            conn.request(method, target, body=body or None, headers=headers)
            r = conn.getresponse()
            data = r.read()
            relayed = {k: v for k, v in r.getheaders() if k.lower() not in HOP_BY_HOP}
            return r.status, relayed, data
        finally:
            conn.close()

    def requests(self, contains: str = "") -> list[ProxiedRequest]:
        return [r for r in self.log if contains in r.target]

    def count_body(self, nbytes: int) -> None:
        with self._body_lock:
            self.body_bytes += nbytes

    def count_abandoned(self) -> None:
        with self._body_lock:
            self.abandoned += 1

    def reset(self) -> None:
        """Clear the log, the counters and every knob."""
        self.log.clear()
        self.body_bytes = self.abandoned = 0
        with self._flight:
            self.peak_in_flight, self.gather_missed = self.in_flight, 0
        self.faults = ProxyFaults(match=self.match)

    def start(self) -> FaultProxy:
        self._httpd = _Server(("127.0.0.1", self.port), _Handler)
        self._httpd.proxy = self
        self.port = self._httpd.server_address[1]
        threading.Thread(target=self._httpd.serve_forever, name="fault-proxy", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._httpd is None:
            return
        httpd, self._httpd = self._httpd, None
        httpd.shutdown()
        with contextlib.suppress(OSError):
            httpd.server_close()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
