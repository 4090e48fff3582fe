"""The shard cache in one process: fill (split by assign_files), reuse, verification, atomic commits, faults."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from otfload.cache import ShardCache, cache_key, wrap_with_cache
from otfload.coordination import LocalCoordinator, assign_files
from otfload.errors import CacheTimeoutError, ChecksumMismatchError, SourceUnavailableError
from otfload.sources import open_source
from otfload.sources.base import read_bytes
from otfload.sources.hub import HubSource
from tests.multihost.conftest import checkpoint_bytes, visible_files
from tests.multihost.launch import start_workers
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer

SHARD = "model-00002-of-00012.safetensors"


@pytest.fixture
def open_hub(hub: HubServer, llama_repo: str, tmp_path: Path, fast_retry, closing):
    def _open(**kw) -> HubSource:  # closed when the test ends
        return closing(HubSource(llama_repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=fast_retry, **kw))

    return _open


def cache_folder(root: Path, source) -> Path:
    return root / cache_key(source)


def assert_complete(folder: Path, files: dict[str, bytes]) -> None:
    """Every visible checkpoint file in ``folder`` is whole; none is missing."""
    visible = {k: v for k, v in visible_files(folder).items() if not k.endswith(".sha256")}
    assert visible == files


# --- fill and reuse --------------------------------------------------------------------------------


def test_fill_fetches_each_file_once_then_reuses_the_committed_copies(open_hub, hub, llama, tmp_path, closing):
    files = checkpoint_bytes(llama)
    cache = closing(ShardCache(open_hub(), tmp_path / "cache"))
    gets = hub.requests("GET", "/resolve/")
    assert sorted(r.path.rsplit("/", 1)[1] for r in gets) == sorted(files)
    assert sorted(cache.fetched) == sorted(files) and cache.reused == []
    assert all(read_bytes(cache, f) == data for f, data in files.items())
    assert_complete(cache_folder(tmp_path / "cache", cache.source), files)

    hub.log.clear()
    again = closing(ShardCache(open_hub(), tmp_path / "cache"))
    assert hub.requests("GET", "/resolve/") == [] and sorted(again.reused) == sorted(files)
    assert read_bytes(again, SHARD, 100, 50) == files[SHARD][100:150]


def test_damaged_copies_are_fetched_again(open_hub, hub, llama, tmp_path, closing):
    files = checkpoint_bytes(llama)
    folder = cache_folder(tmp_path / "cache", closing(ShardCache(open_hub(), tmp_path / "cache")).source)
    (folder / "config.json").write_bytes(b"{}")  # wrong size
    flipped = bytearray(files[SHARD])
    flipped[-1] ^= 1
    (folder / SHARD).write_bytes(bytes(flipped))  # right size, wrong bytes: the sha256 record must not be trusted
    (folder / f"{SHARD}.sha256").unlink()
    hub.log.clear()
    cache = closing(ShardCache(open_hub(), tmp_path / "cache"))
    assert sorted(cache.fetched) == ["config.json", SHARD]
    assert sorted(r.path.rsplit("/", 1)[1] for r in hub.requests("GET", "/resolve/")) == ["config.json", SHARD]
    assert_complete(folder, files)


def test_bytes_that_fail_the_hubs_sha256_are_never_committed(open_hub, hub, llama, tmp_path):
    hub.faults.corrupt.add(f"{SHARD}")
    with pytest.raises(ChecksumMismatchError, match=SHARD):
        ShardCache(open_hub(), tmp_path / "cache")
    folder = cache_folder(tmp_path / "cache", open_hub())
    assert SHARD not in visible_files(folder) and not any(folder.glob(f".{SHARD}*"))  # no temporary left either


def test_gs_cache_commits_whole_objects_and_reuses_them(open_hub, gcs_server: GcsServer, llama, tmp_path, closing):
    files = checkpoint_bytes(llama)
    fs = gcs_server.filesystem()
    fs.mkdir("otfload-cache1")
    prefix = f"gs://otfload-cache1/{tmp_path.name}"
    cache = closing(ShardCache(open_hub(), prefix, storage_options=gcs_server.storage_options))
    assert all(read_bytes(cache, f) == data for f, data in files.items())
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.find(prefix))
    assert names == sorted([*files, *(f"{f}.sha256" for f in files)])  # a record per file, no partials
    again = closing(ShardCache(open_hub(), prefix, storage_options=gcs_server.storage_options))
    assert again.fetched == [] and sorted(again.reused) == sorted(files)


# --- coordination ----------------------------------------------------------------------------------


def test_waiting_for_a_silent_peer_ends_in_a_typed_error_naming_it(open_hub, tmp_path):
    start = time.monotonic()
    with pytest.raises(CacheTimeoutError) as info:
        ShardCache(open_hub(), tmp_path / "cache", coordinator=LocalCoordinator(1, 2), timeout_s=0.5)
    assert time.monotonic() - start < 5
    owners = assign_files({f: open_hub().size(f) for f in open_hub().list_files()}, 2)
    assert info.value.waiter == 1 and info.value.process == 0 and owners[info.value.file] == 0
    assert f"process 0 to commit {info.value.file!r}" in str(info.value)


# --- faults ----------------------------------------------------------------------------------------


def test_a_process_killed_during_fill_leaves_no_partial_file_and_a_rerun_completes(hub, llama_repo, llama, tmp_path):
    hub.faults.delay_s = 0.05  # 4 KiB windows: each shard takes ~15 slow requests
    spec = {"mode": "fill", "local_devices": 1, "source": llama_repo, "window_bytes": 4096,
            "source_options": {"endpoint": hub.url, "cache_dir": str(tmp_path / "hf")},
            "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    [proc] = start_workers(spec, 1, tmp_path / "out")
    try:
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size > 0 for p in (tmp_path / "cache").rglob(".*.partial-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the fill never started writing"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
    files = checkpoint_bytes(llama)
    [folder] = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert any(folder.glob(".*.partial-*"))  # it really died mid-file
    seen = visible_files(folder)
    assert all(seen[f] == files[f] for f in seen if not f.endswith(".sha256"))  # whatever is visible is whole

    hub.reset()
    source = HubSource(llama_repo, endpoint=hub.url, cache_dir=tmp_path / "hf")
    rerun = ShardCache(source, tmp_path / "cache")
    assert sorted(rerun.fetched) == sorted(set(files) - set(seen))
    assert_complete(folder, files)


def test_a_fill_rides_out_a_server_restart(open_hub, hub, llama, tmp_path):
    source = open_hub()
    hub.faults.delay_s = 0.05
    outcome: dict = {}

    def fill() -> None:
        try:
            outcome["cache"] = ShardCache(source, tmp_path / "cache", window_bytes=8192)
        except Exception as e:  # reported to the test thread
            outcome["error"] = e

    thread = threading.Thread(target=fill)
    thread.start()
    time.sleep(0.3)
    hub.stop()
    time.sleep(0.5)
    hub.start()
    thread.join(60)
    assert "error" not in outcome, outcome
    assert_complete(cache_folder(tmp_path / "cache", source), checkpoint_bytes(llama))


def test_a_server_gone_for_good_fails_the_fill_within_the_retry_deadline(open_hub, hub, tmp_path):
    source = open_hub()
    hub.stop()
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="unreachable"):
        ShardCache(source, tmp_path / "cache")
    assert time.monotonic() - start < 10  # FAST_RETRY's 2 s deadline, plus slack for a loaded machine
    assert visible_files(tmp_path / "cache") == {}


# --- choosing the route ----------------------------------------------------------------------------


def test_wrap_with_cache_picks_direct_reads_hf_cache_or_shard_cache(open_hub, llama, tmp_path, monkeypatch, closing):
    local = closing(open_source(llama))
    assert wrap_with_cache(local, tmp_path / "c") is local  # already local: nothing to cache
    hub_source = open_hub()
    assert wrap_with_cache(hub_source) is hub_source  # no cache asked for: direct range reads
    assert wrap_with_cache(hub_source, True) is hub_source  # one host: whole files into the HF cache
    snapshot = tmp_path / "hf" / "models--org--llama-mh" / "snapshots" / hub_source.commit
    assert {p.name: p.read_bytes() for p in snapshot.iterdir()} == checkpoint_bytes(llama)
    cached = closing(wrap_with_cache(open_hub(), tmp_path / "shared"))
    assert isinstance(cached, ShardCache) and cached.store.description.startswith(str(tmp_path / "shared"))
