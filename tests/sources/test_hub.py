"""HubSource against a real Hub-protocol HTTP server on 127.0.0.1 (no mocks), under huggingface_hub 1.x and 2.x."""

from __future__ import annotations

import logging
import threading
import time
import traceback
from pathlib import Path

import pytest

from otfload.errors import (
    ChecksumMismatchError,
    SourceNotFoundError,
    SourcePermissionError,
    SourceUnavailableError,
    TruncatedFileError,
    UnsafeFormatError,
)
from otfload.sources.base import RangeRead, read_bytes
from otfload.sources.hub import HubSource
from otfload.sources.retry import RetryPolicy
from tests.servers.hub_server import HubServer

REPO = "org/tiny"
SHARD = "model-00002-of-00002.safetensors"
SECRET = "hf_sEcReTtOkEn0123456789"


@pytest.fixture(scope="module")
def repo(hub_server: HubServer, checkpoint: Path) -> str:
    return hub_server.add_repo(REPO, checkpoint)


@pytest.fixture
def open_hub(hub: HubServer, repo: str, tmp_path: Path, fast_retry):
    """Open ``repo`` (or another) on the test server with an empty cache and the fast retry policy."""

    def _open(repo_id: str = repo, **kw) -> HubSource:
        kw = {"endpoint": hub.url, "cache_dir": tmp_path / "hf-cache", "retry": fast_retry, **kw}
        return HubSource(repo_id, **kw)

    return _open


def test_lists_checkpoint_files_with_sizes_and_pins_the_commit(open_hub, hub, checkpoint):
    src = open_hub()
    assert src.list_files() == [
        "config.json",
        "model-00001-of-00002.safetensors",
        SHARD,
        "model.safetensors.index.json",
    ]  # README.md is not fetched
    for f in src.list_files():
        assert src.size(f) == (checkpoint / f).stat().st_size
    assert src.commit == hub.commit(REPO)
    assert [r.path for r in hub.log] == [f"/api/models/{REPO}/revision/main"]  # one metadata request


def test_range_reads_return_the_files_bytes(open_hub, hub, checkpoint):
    src = open_hub()
    data = (checkpoint / SHARD).read_bytes()
    for offset, length in [(0, 8), (8, 100), (12345, 70000), (len(data) - 10, 10), (0, len(data))]:
        assert read_bytes(src, SHARD, offset, length) == data[offset : offset + length]
    gets = hub.requests("GET", "/resolve/")
    assert all(r.path == f"/{REPO}/resolve/{src.commit}/{SHARD}" and r.range for r in gets)


def test_read_many_coalesces_and_fills_every_buffer(open_hub, hub, checkpoint):
    src = open_hub()
    data = {f: (checkpoint / f).read_bytes() for f in src.list_files() if f.endswith(".safetensors")}
    spec = [(f, off, 1000) for f in data for off in range(0, len(data[f]) - 1000, 50_000)]
    reads = [RangeRead(f, off, memoryview(bytearray(n))) for f, off, n in spec]
    hub.log.clear()
    src.read_many(reads)
    for r in reads:
        assert bytes(r.out) == data[r.file][r.offset : r.offset + len(r.out)]
    assert len(hub.requests("GET")) == len(data)  # gaps < 1 MiB: one request per file


def test_missing_repo_revision_and_file(open_hub):
    with pytest.raises(SourceNotFoundError, match="org/nope"):
        open_hub("org/nope")
    with pytest.raises(SourceNotFoundError, match="revision 'v9'"):
        open_hub(revision="v9")
    src = open_hub()
    with pytest.raises(SourceNotFoundError, match="nope.safetensors"):
        src.size("nope.safetensors")
    with pytest.raises(TruncatedFileError):
        src.read_into(SHARD, src.size(SHARD) - 4, memoryview(bytearray(8)))


def test_revision_by_commit_sha(open_hub, hub):
    assert open_hub(revision=hub.commit(REPO)).commit == hub.commit(REPO)


def test_bad_token_is_401_and_the_token_never_shows(checkpoint, tmp_path, fast_retry, caplog):
    caplog.set_level(logging.DEBUG)
    with HubServer(tmp_path / "root", token=SECRET) as server:
        server.add_repo(REPO, checkpoint)
        kw = {"endpoint": server.url, "cache_dir": tmp_path / "cache", "retry": fast_retry}
        with pytest.raises(SourcePermissionError) as e:
            HubSource(REPO, token=SECRET[::-1], **kw)
        shown = "".join(traceback.format_exception(e.value))
        assert SECRET[::-1] not in shown and "401" in shown
        src = HubSource(REPO, token=SECRET, **kw)
        assert read_bytes(src, "config.json") == (checkpoint / "config.json").read_bytes()
        src.download("config.json")
        for text in (src.description, repr(src), caplog.text):
            assert SECRET not in text


def test_retries_through_503_bursts(open_hub, hub, checkpoint):
    hub.faults.fail_next = 3
    src = open_hub()  # metadata through the burst
    hub.faults.fail_next = 3
    assert read_bytes(src, SHARD, 100, 5000) == (checkpoint / SHARD).read_bytes()[100:5100]
    assert len(hub.requests("GET", "/resolve/")) == 4


@pytest.mark.parametrize("knob", ["reset_next", "truncate_next"])
def test_connection_reset_or_short_body_mid_range_is_resumed(open_hub, hub, checkpoint, knob):
    src = open_hub()
    setattr(hub.faults, knob, 2)
    assert read_bytes(src, SHARD) == (checkpoint / SHARD).read_bytes()
    ranges = [r.range for r in hub.requests("GET", "/resolve/")]
    assert len(ranges) == 3
    if knob == "truncate_next":  # what arrived is kept: each retry asks only for the rest
        assert ranges[0] != ranges[1] != ranges[2]


def test_endless_truncation_ends_in_unavailable(open_hub, hub):
    src = open_hub()
    hub.faults.truncate_next = 1000
    with pytest.raises(SourceUnavailableError, match=f"{REPO}.*{SHARD}.*attempt"):
        read_bytes(src, SHARD)


def test_server_gone_for_good_fails_within_bounds(open_hub, hub):
    src = open_hub()
    hub.stop()
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match=f"hub:{REPO}@main at {hub.url}: {SHARD}"):
        read_bytes(src, SHARD, 0, 100)
    assert time.monotonic() - start < 3.0  # deadline 2 s + one attempt


def test_server_restarted_mid_load_completes(open_hub, hub, checkpoint):
    src = open_hub(retry=RetryPolicy(attempts=50, base_delay_s=0.05, max_delay_s=0.1, deadline_s=5.0))
    hub.stop()
    threading.Timer(0.3, hub.start).start()
    assert read_bytes(src, SHARD, 0, 1000) == (checkpoint / SHARD).read_bytes()[:1000]


def test_slow_server_times_out_then_unavailable(open_hub, hub):
    src = open_hub()
    hub.faults.delay_s = 1.5  # > attempt_timeout_s
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="Timeout"):
        read_bytes(src, SHARD, 0, 10)
    assert time.monotonic() - start < 4.0


def test_download_verifies_sha256_and_later_reads_are_local(open_hub, hub, checkpoint):
    src = open_hub()
    path = src.download(SHARD)
    assert Path(path).read_bytes() == (checkpoint / SHARD).read_bytes()
    hub.log.clear()
    assert src.download(SHARD) == path
    assert read_bytes(src, SHARD, 10, 10) == (checkpoint / SHARD).read_bytes()[10:20]
    assert hub.log == []


def test_checksum_mismatch_discards_the_cache_entry(open_hub, hub, tmp_path):
    src = open_hub()
    hub.faults.corrupt = {SHARD}
    with pytest.raises(ChecksumMismatchError, match="deleted"):
        src.download(SHARD)
    cached = [p for p in (tmp_path / "hf-cache").rglob("*") if p.is_file() or p.is_symlink()]
    assert not [p for p in cached if "blobs" in p.parts or p.name == SHARD]


def test_offline_reads_the_cached_snapshot(open_hub, hub, checkpoint):
    with pytest.raises(SourceNotFoundError, match="local Hub cache"):
        open_hub(local_files_only=True)
    online = open_hub()
    for f in online.list_files():
        online.download(f)
    hub.stop()
    offline = open_hub(local_files_only=True)
    assert offline.list_files() == online.list_files() and offline.commit == online.commit
    assert read_bytes(offline, SHARD) == (checkpoint / SHARD).read_bytes()


def test_pickle_only_repo_is_refused(open_hub, hub, pickle_checkpoint):
    hub.add_repo("org/pickled", pickle_checkpoint)
    with pytest.raises(UnsafeFormatError, match="pytorch_model.bin.*safetensors"):
        open_hub("org/pickled")


def test_the_http_library_is_the_one_huggingface_hub_uses():
    """huggingface_hub 1.x (the README's second venv) and 2.x (the main one) build their client on
    different libraries: the responses and exceptions the source handles must be the client's."""
    import huggingface_hub
    from huggingface_hub.utils import get_session

    from otfload.sources.hub_http import httpx

    assert isinstance(get_session(), httpx.Client)
    assert int(huggingface_hub.__version__.split(".")[0]) in (1, 2)  # the majors otfload is tested with
