"""Each real source declares the optional capabilities it has (the protocols of
:mod:`otfload.sources.base`), and ``isinstance`` finds exactly those: what the loader's checks see."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from otfload.cache.integrity import published_digests
from otfload.cache.shard_cache import ShardCache
from otfload.coordination import LocalCoordinator
from otfload.sources.base import (
    DigestSource,
    DownloadableSource,
    HashedSource,
    MappedSource,
    PageGranularSource,
    PinnedSource,
    RangePrefetchingSource,
    Source,
)
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.hub import HubSource
from otfload.sources.local import LocalSource
from tests.helpers import memory_copy

CAPABILITIES = (MappedSource, RangePrefetchingSource, PageGranularSource, DownloadableSource, HashedSource,
                DigestSource, PinnedSource)


def declared(source: object) -> set[str]:
    assert isinstance(source, Source)
    return {c.__name__ for c in CAPABILITIES if isinstance(source, c)}


def test_local_source_maps_and_reads_pages(checkpoint: Path):
    src = LocalSource(checkpoint)
    assert declared(src) == {"MappedSource", "RangePrefetchingSource", "PageGranularSource"}
    assert src.page_granular and src.use_mmap


def test_hub_source_downloads_and_publishes_sha256_at_a_pinned_commit(hub, hub_server, checkpoint, tmp_path):
    repo = hub_server.add_repo(f"org/caps-{uuid.uuid4().hex[:8]}", checkpoint)
    src = HubSource(repo, endpoint=hub.url, cache_dir=tmp_path / "hf")
    try:
        assert declared(src) == {"DownloadableSource", "HashedSource", "PinnedSource"}
        assert src.commit == hub.commit(repo)
        shard = "model-00002-of-00002.safetensors"
        assert published_digests(src, shard)["sha256"] == src.sha256(shard)  # an LFS file's sha256
    finally:
        src.close()


def test_fsspec_source_publishes_its_stores_digests(checkpoint: Path):
    assert declared(FsspecSource(memory_copy(checkpoint, "caps"))) == {"DigestSource"}


def test_a_shard_cache_declares_none_of_its_sources_capabilities(checkpoint: Path, tmp_path: Path):
    cache = ShardCache(LocalSource(checkpoint), tmp_path / "cache", coordinator=LocalCoordinator())
    try:
        assert declared(cache) == set()  # reads go through the cache's own copies
    finally:
        cache.close()


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_a_plain_object_has_no_capability(capability):
    assert not isinstance(object(), capability)
