"""Fixtures of the shard-cache tests: small checkpoint-like files served by the real Hub and GCS servers."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest

from otfload.cache import ShardCache
from otfload.coordination import LocalCoordinator
from otfload.sources import Source
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.hub import HubSource
from otfload.sources.retry import RetryPolicy
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer

T = TypeVar("T", Source, ShardCache)
REPO = "org/cache-files"
BUCKET = "otfload-cache-tests"
SHARD = "model-00002-of-00002.safetensors"
# Bytes, not a model: the cache copies files whole and never parses them. A nested name exercises
# folders inside the cache; the larger shard spans several 4 KiB fill windows.
FILES = {
    "config.json": b'{"model_type": "none"}',
    "model-00001-of-00002.safetensors": np.random.default_rng(1).bytes(3000),
    SHARD: np.random.default_rng(2).bytes(70_000),
    "sub/extra.json": b'{"extra": true}',
}
# A dead server is reported within ~2 s; a restart within ~1 s is ridden out.
FAST_RETRY = RetryPolicy(attempts=6, base_delay_s=0.01, max_delay_s=0.1, deadline_s=2.0, attempt_timeout_s=1.0)
_prefixes = itertools.count()


def write_files(root: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


def tree(root: Path) -> dict[str, bytes | str]:
    """Every path under ``root`` (links and folders included, never followed): its bytes, or its kind."""
    out: dict[str, bytes | str] = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        out[rel] = "link" if path.is_symlink() else "dir" if path.is_dir() else path.read_bytes()
    return out


def entries(folder: Path) -> dict[str, bytes]:
    """The committed entries of a cache folder (no records, no hidden temporaries), by name."""
    hidden = lambda k: k.endswith(".sha256") or k.rpartition("/")[2].startswith(".")  # noqa: E731
    return {k: v for k, v in tree(folder).items() if isinstance(v, bytes) and not hidden(k)}


# What the helpers below opened during the running test: closed when it ends (a cache's files and a
# Hub source's connections are descriptors; left open, the module ended with ~18 more than it began).
_opened: list[Source | ShardCache] = []


def _tracked(opened: T) -> T:
    _opened.append(opened)
    return opened


@pytest.fixture(autouse=True)
def close_what_the_test_opened() -> Iterator[None]:
    yield
    while _opened:
        _opened.pop().close()


def fill(source: Source, cache_dir, **options) -> ShardCache:
    """A one-process fill (no JAX coordination) that owns ``source``: the cache is closed, its source
    with it, when the test ends; the source at once when the fill fails."""
    try:
        return _tracked(ShardCache(source, cache_dir, coordinator=LocalCoordinator(), **options))
    except BaseException:
        source.close()
        raise


@pytest.fixture(scope="session")
def files_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_files(tmp_path_factory.mktemp("cache-files"), FILES)


@pytest.fixture(scope="session")
def hub_repo(hub_server: HubServer, files_dir: Path) -> str:
    return hub_server.add_repo(REPO, files_dir)


@pytest.fixture
def open_hub(hub: HubServer, hub_repo: str, tmp_path: Path):
    """Opens the repo on the running Hub server (LFS sha256s for the shards, none for the JSON files)."""
    return lambda: _tracked(HubSource(hub_repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=FAST_RETRY))


@pytest.fixture
def upload(gcs_server: GcsServer):
    """``upload(files) -> gs://`` URL of a fresh prefix holding ``files`` (names taken as given)."""
    fs = gcs_server.filesystem()
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)

    def _upload(files: dict[str, bytes]) -> str:
        prefix = f"{BUCKET}/src{next(_prefixes)}"
        for name, data in files.items():
            fs.pipe_file(f"{prefix}/{name}", data)
        fs.invalidate_cache()
        return f"gs://{prefix}"

    return _upload


@pytest.fixture
def open_gcs(gcs_server: GcsServer):
    """Opens a gs:// URL on the real fake-gcs-server (no published digests: size only)."""
    return lambda url: _tracked(FsspecSource(url, gcs_server.storage_options, retry=FAST_RETRY))


@pytest.fixture
def gs_cache(gcs_server: GcsServer):
    """A fresh gs:// cache prefix on the real fake-gcs-server, and its storage options."""
    fs = gcs_server.filesystem()
    if not fs.exists(BUCKET):
        fs.mkdir(BUCKET)
    return f"gs://{BUCKET}/cache{next(_prefixes)}", gcs_server.storage_options
