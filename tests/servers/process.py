"""A test server run as its own process on a free port of 127.0.0.1, holding buckets of objects."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Self

from .net import free_port, wait_http_ok

STOP_TIMEOUT_S = 5.0


class BucketServer:
    """A subprocess serving an object store; a context manager. Subclasses name the command, the
    path that answers 200 once it is ready, the URL scheme and how a bucket is made."""

    scheme = ""
    ready_path = "/"
    ready_timeout_s = 10.0

    def __init__(self) -> None:
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The server's endpoint (``endpoint_url`` for the filesystem)."""
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        raise NotImplementedError

    def filesystem(self) -> Any:
        """The fsspec filesystem on this server."""
        raise NotImplementedError

    def make_bucket(self, fs: Any, bucket: str) -> None:
        fs.mkdir(bucket)

    def start(self) -> Self:
        """Start the server (on the previous port after a :meth:`stop`) and wait until it answers."""
        self.port = self.port or free_port()
        self._proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http_ok(f"{self.url}{self.ready_path}", self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time. The in-memory data is lost."""
        if self._proc is None:
            return
        try:
            self._proc.send_signal(signal.SIGTERM)
            self._proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        finally:
            self._proc = None

    def upload_dir(self, local_dir: str | os.PathLike, bucket: str, prefix: str) -> str:
        """Copy every file under ``local_dir`` to ``bucket/prefix/``; return its URL (``scheme://bucket/prefix``)."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            self.make_bucket(fs, bucket)
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            fs.pipe_file(f"{bucket}/{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
        fs.invalidate_cache()
        return f"{self.scheme}://{bucket}/{prefix}"

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
