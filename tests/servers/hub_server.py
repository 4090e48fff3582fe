"""A small real HTTP server speaking the Hugging Face Hub download protocol, for tests.

It serves ``ROOT/<org>/<name>/...`` as the model repo ``org/name`` with one commit per repo (its
sha is derived from the repo id; revisions ``main`` and that sha resolve). Enough of the protocol
for ``huggingface_hub`` 2.x: repo info, tree listing, paths-info, and HEAD/GET ``resolve`` with
``ETag``, ``X-Repo-Commit`` and byte ranges. Every request is logged, an optional bearer token is
enforced, and :class:`Faults` injects 5xx bursts, connection resets, truncated bodies, corrupted
bytes and delays, and the hostile answers of issue 13: dripping and stalled bodies, range answers
for other bytes (shifted ``Content-Range``, ``200`` with the whole file, long bodies, a wrong total,
a lying ``Content-Encoding``), broken revision metadata and redirect loops. A network can be shaped
(issue 20): ``delay_s`` is a round trip paid by every request, ``rate_bytes_s`` caps each file
answer and ``link_bytes_s`` all of them together (see :mod:`tests.servers.throttle`); ``gather``
holds file answers until that many are in flight at once, a proof that a client sends them
concurrently. The server counts what clients really asked: requests (:attr:`HubServer.log`), file
body bytes, connections, file GETs in flight at once, and hostile answers the client hung up on
(:attr:`HubServer.abandoned`: a client cancelling its reads leaves them early). A directory URL
under ``resolve`` answers an HTML index of its files, so ``http://`` fsspec URLs work against it too.
"""

from __future__ import annotations

import contextlib
import hashlib
import html
import json
import os
import re
import shutil
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import NamedTuple
from urllib.parse import parse_qs, unquote, urlsplit

from .throttle import GetsInFlight, Link, client_gone, send_paced

CHUNK_BYTES = 1 << 20  # body write size: large enough for GB/s over loopback
STALL_HOLD_S = 30.0  # a stalled answer keeps its connection open this long at most (or until the client leaves)
# Faults.gather: a file GET waits at most this long for the others; a loaded 2-core machine starts a
# client's threads within milliseconds, so only a client sending its requests one by one waits it out.
CAP_RANGE_BYTES = 4096  # range_fault "cap": honest answers of at most this many bytes (as some CDNs do)
LONG_EXTRA_BYTES = 16  # range_fault "long"/"long_chunked": bytes sent beyond the range asked
# range_fault values: how a ranged file GET lies (see Faults)
RANGE_FAULTS = ("shift", "full", "long", "long_chunked", "total", "missing", "cap", "gzip")
# metadata_fault values: how the revision-info JSON is broken (see Faults)
METADATA_FAULTS = (
    "not_json", "array", "negative_size", "huge_size", "missing_size", "string_size", "missing_sha", "bad_sha",
    "missing_siblings", "rfilename_int", "bad_lfs", "gzip", "drip", "stall",
)  # fmt: skip
LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")  # files the Hub stores through LFS
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class LoggedRequest(NamedTuple):
    """One request as the server saw it; ``range`` and ``authorization`` are the raw headers or None."""

    method: str
    path: str
    range: str | None
    authorization: str | None = None


@dataclass
class Faults:
    """Fault injection knobs; counters are consumed one per matching request."""

    fail_next: int = 0  # answer the next N requests with ``fail_status``
    fail_status: int = 503
    reset_next: int = 0  # next N file GETs: send half the body, then reset the connection (RST)
    truncate_next: int = 0  # next N file GETs: send half the body, then close cleanly (short body)
    corrupt: set[str] = field(default_factory=set)  # file paths served with one byte flipped
    delay_s: float = 0.0  # sleep before answering every request (a round trip's latency)
    rate_bytes_s: float = 0.0  # cap on each file answer's body (one TCP stream's share); 0: none
    link_bytes_s: float = 0.0  # cap on all file answers' bodies together (the host's link); 0: none
    # file GETs wait until this many have been in flight at once (HubServer.peak_in_flight); one that
    # waits GATHER_TIMEOUT_S in vain is answered anyway and counted in HubServer.gather_missed
    gather: int = 0
    drip_next: int = 0  # next N file GETs: headers, then one body byte every ``drip_interval_s``
    drip_interval_s: float = 1.0
    stall_next: int = 0  # next N file GETs: half the body, then silence with the connection kept open
    # the next ``range_fault_next`` ranged file GETs lie as ``range_fault`` says:
    #   shift: Content-Range (and body) one byte off; full: 200 with the whole file; long: Content-Length
    #   and body longer than the range; long_chunked: the same without Content-Length; total: a wrong
    #   file size in Content-Range; missing: 206 without Content-Range; cap: an honest shorter range;
    #   gzip: "Content-Encoding: gzip" on raw bytes
    range_fault: str = ""
    range_fault_next: int = 0
    # every revision-info answer is broken as ``metadata_fault`` says (one of METADATA_FAULTS)
    metadata_fault: str = ""
    redirect_loop: bool = False  # resolve GETs answer 302 to themselves
    redirect_to: str = ""  # resolve GETs answer 302 to this base URL + their path (a CDN's)
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
        """The link every file answer shares, capped at the current ``link_bytes_s``."""
        self._link.rate_bytes_s = self.link_bytes_s
        return self._link


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob with ``data``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class _FileInfo(NamedTuple):
    size: int
    oid: str
    sha256: str | None


class _Repo:
    """One repo directory: its commit sha and per-file hashes (cached by size and mtime)."""

    def __init__(self, repo_id: str, path: Path):
        self.repo_id, self.path = repo_id, path
        self.sha = hashlib.sha1(repo_id.encode()).hexdigest()
        self._infos: dict[str, tuple[tuple[int, int], _FileInfo]] = {}
        self._lock = threading.Lock()

    def files(self) -> list[str]:
        return sorted(p.relative_to(self.path).as_posix() for p in self.path.rglob("*") if p.is_file())

    def file(self, name: str) -> Path | None:
        path = (self.path / name).resolve()
        return path if path.is_file() and self.path.resolve() in path.parents else None

    def info(self, name: str) -> _FileInfo:
        path = self.path / name
        st = path.stat()
        key = (st.st_size, st.st_mtime_ns)
        with self._lock:
            cached = self._infos.get(name)
        if cached and cached[0] == key:
            return cached[1]
        data = path.read_bytes()
        lfs = name.endswith(LFS_SUFFIXES)
        info = _FileInfo(len(data), git_blob_sha1(data), hashlib.sha256(data).hexdigest() if lfs else None)
        with self._lock:
            self._infos[name] = (key, info)
        return info

    def entry(self, name: str) -> dict:
        """A tree / paths-info entry for a file, with LFS metadata for large-file types."""
        info = self.info(name)
        entry = {"type": "file", "path": name, "size": info.size, "oid": info.oid}
        if info.sha256:
            entry["lfs"] = {"oid": info.sha256, "size": info.size, "pointerSize": 134}
        return entry

    def tree(self, prefix: str, recursive: bool) -> list[dict] | None:
        base = prefix.strip("/")
        if base and not (self.path / base).is_dir():
            return None
        out: list[dict] = []
        dirs: set[str] = set()
        for name in self.files():
            if base and not name.startswith(base + "/"):
                continue
            parts = (name[len(base) + 1 :] if base else name).split("/")
            parents = ["/".join(parts[:i]) for i in range(1, len(parts))]
            dirs.update(f"{base}/{d}" if base else d for d in (parents if recursive else parents[:1]))
            if recursive or len(parts) == 1:
                out.append(self.entry(name))
        out += [{"type": "directory", "path": d, "size": 0, "oid": git_blob_sha1(d.encode())} for d in sorted(dirs)]
        return out


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    hub: HubServer

    def handle_error(self, request: object, client_address: object) -> None:
        """Connections the faults (or a client giving up) broke are expected: no traceback on stderr."""
        if not isinstance(sys.exc_info()[1], OSError | ValueError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the real Hub
    server: _Server
    # Ends the current resolve GET's time in flight; called before its last body bytes are written, so
    # a client's next request (sent once it has them all) never overlaps it in HubServer.in_flight.
    _answered: Callable[[], None] = staticmethod(lambda: None)

    def setup(self) -> None:
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.hub._track(self.request, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.hub._track(self.request, add=False)

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - silence stderr access log
        pass

    # --- responses -------------------------------------------------------------------------------

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, payload: object, headers: dict[str, str] | None = None) -> None:
        self._send(200, json.dumps(payload).encode(), {"Content-Type": "application/json", **(headers or {})})

    def _error(self, status: int, code: str | None, message: str, headers: dict[str, str] | None = None) -> None:
        extra = {"Content-Type": "application/json", "X-Error-Message": message, **(headers or {})}
        if code:
            extra["X-Error-Code"] = code
        self._send(status, json.dumps({"error": message}).encode(), extra)

    # --- dispatch --------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch()

    def do_HEAD(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        hub = self.server.hub
        url = urlsplit(self.path)
        path = unquote(url.path)
        hub.log.append(LoggedRequest(self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if hub.faults.delay_s:
            time.sleep(hub.faults.delay_s)
        if hub.faults.take("fail_next"):
            self._error(hub.faults.fail_status, None, "injected failure")
            return
        if hub.token is not None:
            auth = self.headers.get("Authorization")
            if auth is None:
                self._error(401, "RepoNotFound", "Repository not found")
                return
            if auth != f"Bearer {hub.token}":
                self._error(401, None, "Invalid credentials in Authorization header")
                return
        params = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            self._repo_info(m[1], m[2] or "main", params.get("blobs") == "true")
        elif m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
            self._tree(m[1], m[2], m[3] or "", params.get("recursive", "").lower() == "true")
        elif self.command == "POST" and (m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/paths-info/([^/]+)", path)):
            self._paths_info(m[1], m[2], parse_qs(body.decode()).get("paths", []))
        elif m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/?(.*)", path):
            with hub.answering(self.command == "GET") as self._answered:
                self._resolve(m[1], m[2], m[3])
        else:
            self._error(404, None, f"no route for {self.command} {path}")

    def _repo(self, repo_id: str, revision: str) -> _Repo | None:
        repo = self.server.hub.repo(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            return None
        if revision not in ("main", repo.sha):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}", {"X-Repo-Commit": repo.sha})
            return None
        return repo

    def _repo_info(self, repo_id: str, revision: str, blobs: bool) -> None:
        if repo := self._repo(repo_id, revision):
            siblings = []
            for name in repo.files():
                sib: dict = {"rfilename": name}
                if blobs:
                    e = repo.entry(name)
                    sib.update(size=e["size"], blobId=e["oid"])
                    if "lfs" in e:
                        sib["lfs"] = {"sha256": e["lfs"]["oid"], "size": e["size"], "pointerSize": 134}
                siblings.append(sib)
            info = {"id": repo_id, "modelId": repo_id, "sha": repo.sha, "private": False, "siblings": siblings}
            fault = self.server.hub.faults.metadata_fault
            if fault:
                self._broken_metadata(fault, info)
            else:
                self._json(info)

    def _broken_metadata(self, fault: str, info: dict) -> None:
        """Answer the revision info ``info`` broken as ``fault`` (one of METADATA_FAULTS) says."""
        sibs = info["siblings"]
        lfs_sib = next((sib for sib in sibs if "lfs" in sib), sibs[0] if sibs else {})
        if fault == "not_json":
            self._send(200, b"<html>502 Bad Gateway</html>", {"Content-Type": "application/json"})
            return
        if fault == "array":
            self._json([info])
            return
        if fault in ("gzip", "drip", "stall"):
            body = json.dumps(info).encode()
            if fault == "gzip":  # a lying Content-Encoding: the body is plain JSON
                self._send(200, body, {"Content-Type": "application/json", "Content-Encoding": "gzip"})
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if fault == "drip":
                self._drip(body)
            else:
                self._hold(body[: len(body) // 2])
            return
        edits = {
            "negative_size": lambda: lfs_sib.update(size=-1),
            "huge_size": lambda: lfs_sib.update(size=1 << 62),
            "missing_size": lambda: lfs_sib.pop("size", None),
            "string_size": lambda: lfs_sib.update(size="12"),
            "missing_sha": lambda: info.pop("sha"),
            "bad_sha": lambda: info.update(sha="../../../../tmp/evil"),
            "missing_siblings": lambda: info.pop("siblings"),
            "rfilename_int": lambda: sibs.append({"rfilename": 7, "size": 1}),
            "bad_lfs": lambda: lfs_sib.update(lfs={"sha256": 12}),
        }
        edits[fault]()
        self._json(info)

    def _tree(self, repo_id: str, revision: str, prefix: str, recursive: bool) -> None:
        if repo := self._repo(repo_id, revision):
            entries = repo.tree(prefix, recursive)
            if entries is None:
                self._error(404, "EntryNotFound", f"{prefix} does not exist on {revision}")
            else:
                self._json(entries)

    def _paths_info(self, repo_id: str, revision: str, paths: list[str]) -> None:
        if repo := self._repo(repo_id, revision):
            self._json([repo.entry(p) for p in paths if repo.file(p)])

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        commit = {"X-Repo-Commit": repo.sha}
        faults = self.server.hub.faults
        if faults.redirect_loop and self.command == "GET":
            self._send(302, b"", {"Location": self.path, **commit})
            return
        if faults.redirect_to and self.command == "GET":
            self._send(302, b"", {"Location": faults.redirect_to + urlsplit(self.path).path, **commit})
            return
        folder, root = (repo.path / name).resolve(), repo.path.resolve()
        if folder.is_dir() and (folder == root or root in folder.parents):
            self._index(repo, name.strip("/"))
            return
        path = repo.file(name)
        if path is None:
            self._error(404, "EntryNotFound", f"{name} does not exist on {revision}", commit)
            return
        info = repo.info(name)
        headers = {**commit, "ETag": f'"{info.sha256 or info.oid}"', "Accept-Ranges": "bytes"}
        start, end, status = 0, info.size, 200
        if (spec := self.headers.get("Range")) is not None:
            rng = _parse_range(spec, info.size)
            if rng is None:
                self._error(416, None, "range not satisfiable", {**headers, "Content-Range": f"bytes */{info.size}"})
                return
            (start, end), status = rng, 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{info.size}"
        fault = (
            faults.range_fault if status == 206 and self.command == "GET" and faults.take("range_fault_next") else ""
        )
        extra, length = 0, end - start
        if fault == "shift":  # the neighbouring bytes, labelled as such
            step = 1 if end < info.size else -1
            start, end = start + step, end + step
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{info.size}"
        elif fault == "full":
            start, end, status = 0, info.size, 200
            del headers["Content-Range"]
        elif fault in ("long", "long_chunked"):
            extra = LONG_EXTRA_BYTES
        elif fault == "total":
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{info.size + 1}"
        elif fault == "missing":
            del headers["Content-Range"]
        elif fault == "cap":
            end = min(end, start + CAP_RANGE_BYTES)
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{info.size}"
        elif fault == "gzip":
            headers["Content-Encoding"] = "gzip"
        length = end - start + extra
        self.send_response(status)
        if fault == "long_chunked":
            headers["Transfer-Encoding"] = "chunked"
        else:
            headers["Content-Length"] = str(length)
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command == "HEAD":
            return
        if fault == "long_chunked":
            data = _read_range(path, start, end + extra)
            self.wfile.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
            return
        if faults.take("drip_next"):
            self._drip(_read_range(path, start, end + extra), faults.drip_interval_s)
            return
        if faults.take("stall_next"):
            self._hold(_read_range(path, start, start + (end - start) // 2))
            return
        self._send_body(path, name, start, end, extra)

    def _index(self, repo: _Repo, prefix: str) -> None:
        """An HTML page linking every file under ``prefix`` (what fsspec's HTTP listing reads)."""
        names = [n for n in repo.files() if not prefix or n.startswith(prefix + "/")]
        rel = [n[len(prefix) + 1 :] if prefix else n for n in names]
        links = "".join(f'<a href="{html.escape(n)}">{html.escape(n)}</a>\n' for n in rel)
        self._send(200, f"<html><body>\n{links}</body></html>".encode(), {"Content-Type": "text/html"})

    def _drip(self, body: bytes, interval_s: float | None = None) -> None:
        """Send ``body`` one byte at a time, ``interval_s`` apart, until done or the client leaves."""
        interval_s = self.server.hub.faults.drip_interval_s if interval_s is None else interval_s
        self.close_connection = True
        try:
            for i in range(len(body)):
                self.wfile.write(body[i : i + 1])
                self.wfile.flush()
                if self._client_gone(interval_s):
                    self.server.hub.count_abandoned()
                    return
        except OSError:  # the client gave up: what the test wanted
            self.server.hub.count_abandoned()
            return

    def _hold(self, head: bytes = b"") -> None:
        """Send ``head``, then keep the connection open and silent until the client leaves (or
        STALL_HOLD_S passes). A client gone before or meanwhile counts in ``HubServer.abandoned``."""
        self.close_connection = True
        try:
            self.wfile.write(head)
            self.wfile.flush()
        except OSError:  # the client left before the stall began
            self.server.hub.count_abandoned()
            return
        deadline = time.monotonic() + STALL_HOLD_S
        while time.monotonic() < deadline and self.server.hub.running:
            if self._client_gone(0.05):
                self.server.hub.count_abandoned()
                return

    def _client_gone(self, wait_s: float) -> bool:
        """Wait up to ``wait_s``; True if the client closed its end meanwhile."""
        return client_gone(self.request, wait_s)

    def _send_body(self, path: Path, name: str, start: int, end: int, extra: int = 0) -> None:
        faults = self.server.hub.faults
        if extra:
            self.wfile.write(_read_range(path, start, end + extra))
            return
        middle = start + (end - start) // 2
        reset, truncate = faults.take("reset_next"), faults.take("truncate_next")
        stop = middle if reset or truncate else end
        with open(path, "rb") as f:
            f.seek(start)
            pos = start
            while pos < stop:
                chunk = bytearray(f.read(min(CHUNK_BYTES, stop - pos)))
                if name in faults.corrupt and pos <= middle < pos + len(chunk):
                    chunk[middle - pos] ^= 0xFF
                if pos + len(chunk) >= stop:
                    self._answered()
                send_paced(self.wfile.write, chunk, faults.rate_bytes_s, faults.link())
                self.server.hub.count_body(len(chunk))
                pos += len(chunk)
        if reset or truncate:
            self.close_connection = True
        if reset:  # linger 0: close() sends RST instead of FIN
            self.request.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.request.close()
        elif truncate:  # FIN before Content-Length bytes: a short body
            self.request.shutdown(socket.SHUT_WR)


def _read_range(path: Path, start: int, end: int) -> bytes:
    """Bytes ``[start, end)`` of ``path``, zero-padded past its end."""
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(end - start)
    return data + bytes(end - start - len(data))


def _parse_range(spec: str, size: int) -> tuple[int, int] | None:
    """``[start, end)`` for a single-range ``Range`` header, or None when unsatisfiable."""
    m = _RANGE.match(spec.strip())
    if m is None or (not m[1] and not m[2]):
        return None
    if not m[1]:  # suffix range: the last N bytes
        return (max(0, size - int(m[2])), size) if int(m[2]) > 0 and size > 0 else None
    start = int(m[1])
    end = min(size, int(m[2]) + 1) if m[2] else size
    return (start, end) if start < size and start < end else None


class HubServer(GetsInFlight):
    """A Hub-protocol HTTP server on 127.0.0.1 serving ``root``; use as a context manager.

    ``token``: if set, every request must carry ``Authorization: Bearer <token>`` (else 401).
    :meth:`stop` then :meth:`start` restarts on the same port (for outage tests).
    """

    def __init__(self, root: str | os.PathLike, token: str | None = None):
        self.root = Path(root)
        self.token = token
        self.faults = Faults()
        self.log: list[LoggedRequest] = []
        self.body_bytes = 0  # file bytes sent in answers to file GETs (what clients really fetched)
        self._body_lock = threading.Lock()
        self.port = 0
        self._httpd: _Server | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self.connections = 0  # connections accepted since the last reset (keep-alive reuse shows here)
        self.peak_connections = 0  # most connections open at once since the last reset
        self.in_flight = 0  # resolve GETs being answered now
        self.peak_in_flight = 0  # most resolve GETs answered at once since the last reset
        self.gather_missed = 0  # resolve GETs that waited for Faults.gather in vain
        self.abandoned = 0  # dripping or stalled answers whose client hung up before the server gave up
        self._flight = threading.Condition()
        self._repos: dict[str, _Repo] = {}

    @property
    def url(self) -> str:
        """Base URL, to use as ``endpoint`` / ``HF_ENDPOINT``."""
        return f"http://127.0.0.1:{self.port}"

    def repo(self, repo_id: str) -> _Repo | None:
        """The repo ``org/name`` if its directory exists."""
        path = self.root / repo_id
        if not path.is_dir():
            return None
        if repo_id not in self._repos or self._repos[repo_id].path != path:
            self._repos[repo_id] = _Repo(repo_id, path)
        return self._repos[repo_id]

    def add_repo(self, repo_id: str, files_from: str | os.PathLike) -> str:
        """Copy the directory ``files_from`` in as repo ``repo_id`` (merging with what is there)."""
        shutil.copytree(files_from, self.root / repo_id, dirs_exist_ok=True)
        return repo_id

    def commit(self, repo_id: str) -> str:
        """The 40-hex commit sha the server reports for ``repo_id``."""
        return hashlib.sha1(repo_id.encode()).hexdigest()

    def requests(self, method: str | None = None, contains: str = "") -> list[LoggedRequest]:
        """Logged requests, optionally only those with ``method`` whose path contains ``contains``."""
        return [r for r in self.log if (method is None or r.method == method) and contains in r.path]

    def count_body(self, nbytes: int) -> None:
        with self._body_lock:
            self.body_bytes += nbytes

    def count_abandoned(self) -> None:
        with self._body_lock:
            self.abandoned += 1

    def reset(self) -> None:
        """Clear the log, the byte count and every fault knob (the token is kept)."""
        self.log.clear()
        self.body_bytes = self.abandoned = 0
        with self._conns_lock:
            self.connections, self.peak_connections = 0, len(self._conns)
        with self._flight:
            self.peak_in_flight, self.gather_missed = self.in_flight, 0
        self.faults = Faults()

    @property
    def running(self) -> bool:
        return self._httpd is not None

    def open_connections(self) -> int:
        """Client connections open now."""
        with self._conns_lock:
            return len(self._conns)

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._conns_lock:
            (self._conns.add if add else self._conns.discard)(conn)
            self.connections += add
            self.peak_connections = max(self.peak_connections, len(self._conns))

    def start(self) -> HubServer:
        """Listen (on the previous port after a :meth:`stop`) and serve in a background thread."""
        self._httpd = _Server(("127.0.0.1", self.port), _Handler)
        self._httpd.hub = self
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop listening and drop every open connection (clients see the server gone)."""
        if self._httpd is None:
            return
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._conns_lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):  # already closed by its client
                    conn.shutdown(socket.SHUT_RDWR)
        self._httpd = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
