"""FsspecSource against the real fake-gcs-server (gs://) and fsspec's memory:// and file://."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import fsspec
import pytest

from otfload.errors import SourceNotFoundError, SourceUnavailableError, TruncatedFileError, UnsafeFormatError
from otfload.sources.base import RangeRead, read_bytes
from otfload.sources.fsspec_source import FsspecSource
from tests.helpers import memory_copy
from tests.servers.gcs_server import GcsServer

SHARD = "model-00002-of-00002.safetensors"
CHECKPOINT_FILES = ["config.json", "model-00001-of-00002.safetensors", SHARD, "model.safetensors.index.json"]


@pytest.fixture(scope="module")
def gs_url(gcs_server: GcsServer, checkpoint: Path) -> str:
    return gcs_server.upload_dir(checkpoint, "otfload-test", "models/tiny")



def check_reads(src: FsspecSource, local: Path) -> None:
    assert src.list_files() == CHECKPOINT_FILES
    for f in CHECKPOINT_FILES:
        assert src.size(f) == (local / f).stat().st_size
    data = (local / SHARD).read_bytes()
    for offset, length in [(0, 8), (8, 1000), (len(data) - 7, 7), (0, len(data))]:
        assert read_bytes(src, SHARD, offset, length) == data[offset : offset + length]
    reads = [RangeRead(SHARD, off, memoryview(bytearray(777))) for off in range(0, len(data) - 777, 40_000)]
    src.read_many(reads)
    assert all(bytes(r.out) == data[r.offset : r.offset + 777] for r in reads)


def test_gcs_listing_and_range_reads(gs_url, gcs_server, checkpoint, fast_retry):
    check_reads(FsspecSource(gs_url, gcs_server.storage_options, retry=fast_retry), checkpoint)


def test_memory_and_file_urls(checkpoint):
    check_reads(FsspecSource(memory_copy(checkpoint)), checkpoint)
    check_reads(FsspecSource(checkpoint.as_uri()), checkpoint)


@pytest.mark.parametrize("url", ["gs://no-such-bucket/x", "gs://otfload-test/models/none"])
def test_missing_bucket_or_prefix(gs_url, gcs_server, url, fast_retry):
    with pytest.raises(SourceNotFoundError, match=url):
        FsspecSource(url, gcs_server.storage_options, retry=fast_retry)


def test_missing_file_and_read_past_end(gs_url, gcs_server, fast_retry):
    src = FsspecSource(gs_url, gcs_server.storage_options, retry=fast_retry)
    with pytest.raises(SourceNotFoundError, match="nope.json"):
        src.size("nope.json")
    with pytest.raises(TruncatedFileError):
        src.read_into(SHARD, src.size(SHARD) - 2, memoryview(bytearray(4)))


def test_gcs_server_gone_for_good_fails_within_bounds(checkpoint, fast_retry):
    with GcsServer() as server:
        src = FsspecSource(server.upload_dir(checkpoint, "gone", "m"), server.storage_options, retry=fast_retry)
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="gs://gone/m: model"):
        read_bytes(src, SHARD, 0, 100)
    assert time.monotonic() - start < 4.0  # deadline 2 s + one attempt of 1 s


def test_credentials_in_url_are_not_shown():
    fsspec.filesystem("memory").pipe_file("memory://user:s3cret@creds/a.safetensors", b"x" * 8)
    src = FsspecSource("memory://user:s3cret@creds")
    assert src.list_files() == ["a.safetensors"]
    with pytest.raises(SourceNotFoundError) as e:
        src.size("b.safetensors")
    for text in (src.description, repr(src), str(e.value)):
        assert "s3cret" not in text


def test_pickle_only_prefix_is_refused(pickle_checkpoint):
    with pytest.raises(UnsafeFormatError, match="pytorch_model.bin"):
        FsspecSource(memory_copy(pickle_checkpoint))


def test_gcs_publishes_each_objects_md5_and_crc32c_from_the_listing(gs_url, gcs_server, checkpoint, fast_retry):
    import base64
    import hashlib

    import google_crc32c

    src = FsspecSource(gs_url, gcs_server.storage_options, retry=fast_retry)
    data = (checkpoint / SHARD).read_bytes()
    digests = src.digests(SHARD)
    assert digests["md5"] == base64.b64encode(hashlib.md5(data).digest()).decode()
    assert digests["crc32c"] == base64.b64encode(google_crc32c.Checksum(data).digest()).decode()
    assert FsspecSource(memory_copy(checkpoint)).digests(SHARD) == {}  # memory:// publishes none



def test_a_gone_store_says_once_that_it_retries(checkpoint, fast_retry):
    """A ``gs://`` store that went away announces its retries once per source (after
    ``notice_after_s``, as the Hub does), naming where, then fails as before."""
    import warnings

    from otfload.sources.retry import SourceRetryingWarning

    policy = dataclasses.replace(fast_retry, notice_after_s=0.2)
    with GcsServer() as server:
        src = FsspecSource(server.upload_dir(checkpoint, "gone", "m"), server.storage_options, retry=policy)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            with pytest.raises(SourceUnavailableError, match="gs://gone/m: model"):
                read_bytes(src, SHARD, 0, 100)
    notices = [str(w.message) for w in seen if issubclass(w.category, SourceRetryingWarning)]
    assert len(notices) == 1 and notices[0].startswith("gs://gone: unreachable"), notices
