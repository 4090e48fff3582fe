"""A real S3-compatible server: moto in server mode, in its own process on 127.0.0.1."""

from __future__ import annotations

import sys
from typing import Any

from .process import BucketServer

REGION = "us-east-1"
# moto checks no signature, but botocore signs every request and needs credentials to do it.
CREDENTIALS = {"key": "otfload-test", "secret": "otfload-test-secret"}


class S3Server(BucketServer):
    """moto's S3, state in memory; use as a context manager."""

    scheme = "s3"
    ready_path = "/moto-api/"
    ready_timeout_s = 30.0  # moto imports Flask and its S3 backend in ~1.5 s; allow for a loaded CI machine

    @property
    def storage_options(self) -> dict:
        """s3fs options reaching this server."""
        return self.options_for(self.url)

    @staticmethod
    def options_for(endpoint: str) -> dict:
        """s3fs options reaching this server through ``endpoint`` (e.g. a proxy in front of it)."""
        return {"endpoint_url": endpoint, **CREDENTIALS, "client_kwargs": {"region_name": REGION}}

    def filesystem(self) -> Any:
        """An ``s3fs.S3FileSystem`` on this server (s3fs imported only here: the Hub tests also run
        in a venv without it)."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)]

    def make_bucket(self, fs: Any, bucket: str) -> None:
        fs.call_s3("create_bucket", Bucket=bucket)  # in us-east-1: no location constraint to give
