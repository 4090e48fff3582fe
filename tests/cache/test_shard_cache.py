"""Integrity of cached bytes: what enters the cache is verified as it streams and recorded; what is
reused must match its record (``verify="record"``) or be hashed again (``verify="full"``); a copy
that changed is fetched again, or is a typed error when the source is gone; a killed fill's
temporaries are removed by the next one."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import gcsfs
import pytest

from otfload.cache import cache_key
from otfload.cache.integrity import Record
from otfload.errors import CacheIntegrityError, ChecksumMismatchError, SourceUnavailableError
from otfload.sources.base import read_bytes
from otfload.sources.fsspec_source import FsspecSource
from tests.cache.conftest import FAST_RETRY, FILES, SHARD, entries, fill, tree
from tests.multihost.launch import start_workers
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer

KILL_DEADLINE_S = 60  # the killed fill must have started writing by then (worker start included)


def _flip(path: Path, offset: int = 100, restore_mtime: bool = False) -> None:
    """Change one byte in place (same size), as bit rot or a stray writer would."""
    before = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    if restore_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def _record(folder: Path, name: str) -> dict:
    return json.loads((folder / f"{name}.sha256").read_text())


class PublishingGcsSource(FsspecSource):
    """A gs:// source that publishes each object's own GCS ``md5Hash`` and ``crc32c`` (read from the
    server's object metadata), or the values in ``claims`` instead: a source whose metadata lies."""

    def __init__(self, url: str, storage_options: dict, claims: dict[str, dict[str, str]] | None = None):
        super().__init__(url, storage_options, retry=FAST_RETRY)
        self._metadata = gcsfs.GCSFileSystem(**storage_options)
        self._prefix = url.removeprefix("gs://")
        self.claims = claims or {}

    def digests(self, file: str) -> dict[str, str]:
        info = self._metadata.info(f"{self._prefix}/{file}")
        return {"md5": info["md5Hash"], "crc32c": info["crc32c"], **self.claims.get(file, {})}


# --- verified on the way in ------------------------------------------------------------------------


def test_every_file_is_recorded_with_its_size_hash_revision_and_the_hubs_sha256(open_hub, tmp_path: Path):
    cache = fill(open_hub(), tmp_path / "cache")
    folder = tmp_path / "cache" / cache_key(cache.source)
    for name, data in FILES.items():
        record = _record(folder, name)
        assert record["size"] == len(data) and record["sha256"] == hashlib.sha256(data).hexdigest()
        assert record["revision"] == cache.source.commit
        stat = (folder / name).stat()
        assert record["stamp"] == {"mtime_ns": str(stat.st_mtime_ns), "ctime_ns": str(stat.st_ctime_ns)}
    assert _record(folder, SHARD)["published"] == {"sha256": hashlib.sha256(FILES[SHARD]).hexdigest()}
    assert _record(folder, "config.json")["published"] == {}  # not an LFS file: the Hub publishes no sha256


def test_gcs_md5_and_crc32c_are_checked_as_the_file_streams_in(upload, gcs_server: GcsServer, tmp_path: Path):
    url = upload(FILES)
    cache = fill(PublishingGcsSource(url, gcs_server.storage_options), tmp_path / "cache")
    folder = tmp_path / "cache" / cache_key(cache.source)
    md5 = base64.b64encode(hashlib.md5(FILES[SHARD]).digest()).decode()
    assert _record(folder, SHARD)["published"]["md5"] == md5 and "crc32c" in _record(folder, SHARD)["published"]
    assert entries(folder) == FILES


@pytest.mark.parametrize("algorithm", ["md5", "crc32c"])
def test_bytes_that_fail_a_published_gcs_checksum_are_never_committed(
    algorithm, upload, gcs_server: GcsServer, tmp_path: Path
):
    url = upload(FILES)
    wrong = base64.b64encode(hashlib.md5(b"other").digest() if algorithm == "md5" else b"\0\0\0\0").decode()
    source = PublishingGcsSource(url, gcs_server.storage_options, claims={SHARD: {algorithm: wrong}})
    with pytest.raises(ChecksumMismatchError, match=f"{SHARD} fetched with {algorithm}"):
        fill(source, tmp_path / "cache")
    names = tree(tmp_path / "cache")
    assert not any(k.endswith(SHARD) or SHARD in k.rpartition("/")[2] for k in names)  # no copy, no temporary


def test_an_object_replaced_at_the_source_is_fetched_again(upload, gcs_server: GcsServer, tmp_path: Path):
    url = upload(FILES)
    fill(PublishingGcsSource(url, gcs_server.storage_options), tmp_path / "cache")
    changed = bytes(reversed(FILES[SHARD]))  # same size, new bytes, new md5
    gcs_server.filesystem().pipe_file(f"{url.removeprefix('gs://')}/{SHARD}", changed)
    again = fill(PublishingGcsSource(url, gcs_server.storage_options), tmp_path / "cache")
    assert again.fetched == [SHARD] and again.repaired == []  # the source changed, not the cache
    assert read_bytes(again, SHARD) == changed


# --- checked on the way out ------------------------------------------------------------------------


@pytest.mark.parametrize("restore_mtime", [False, True], ids=["in place", "mtime put back"])
def test_a_same_size_change_after_a_complete_fill_is_detected_and_fetched_again(
    restore_mtime, upload, open_gcs, tmp_path: Path
):
    url = upload(FILES)  # a source that publishes no hash: the record is all there is
    first = fill(open_gcs(url), tmp_path / "cache")
    assert sorted(first.fetched) == sorted(FILES)
    folder = tmp_path / "cache" / cache_key(first.source)
    _flip(folder / SHARD, restore_mtime=restore_mtime)
    _flip(folder / "sub" / "extra.json", offset=3, restore_mtime=restore_mtime)

    again = fill(open_gcs(url), tmp_path / "cache")
    assert sorted(again.repaired) == sorted(again.fetched) == [SHARD, "sub/extra.json"]
    assert entries(folder) == FILES
    assert read_bytes(again, SHARD) == FILES[SHARD]


def test_full_verification_rehashes_what_a_consistent_record_would_hide(upload, open_gcs, tmp_path: Path):
    url = upload(FILES)
    fill(open_gcs(url), tmp_path / "cache")
    folder = tmp_path / "cache" / cache_key(open_gcs(url))
    _flip(folder / SHARD)
    record = _record(folder, SHARD)  # a record re-stamped over changed bytes (a tool that "fixes" records)
    stat = (folder / SHARD).stat()
    record["stamp"] = {"mtime_ns": str(stat.st_mtime_ns), "ctime_ns": str(stat.st_ctime_ns)}
    (folder / f"{SHARD}.sha256").write_text(json.dumps(record))

    trusting = fill(open_gcs(url), tmp_path / "cache")  # "record": an unchanged stamp is trusted, no hashing
    assert SHARD in trusting.reused and trusting.repaired == []
    full = fill(open_gcs(url), tmp_path / "cache", verify="full")
    assert full.repaired == [SHARD] and sorted(full.reused) == sorted(set(FILES) - {SHARD})
    assert read_bytes(full, SHARD) == FILES[SHARD]
    with pytest.raises(ValueError, match="verify='sometimes'"):
        fill(open_gcs(url), tmp_path / "cache", verify="sometimes")


def test_a_changed_copy_with_the_source_gone_is_a_typed_integrity_error(open_hub, hub: HubServer, tmp_path: Path):
    fill(open_hub(), tmp_path / "cache")
    source = open_hub()
    folder = tmp_path / "cache" / cache_key(source)
    _flip(folder / "config.json", offset=2)  # not an LFS file: only the record can tell
    hub.stop()
    start = time.monotonic()
    with pytest.raises(CacheIntegrityError, match="its bytes changed since it was filled") as info:
        fill(source, tmp_path / "cache")
    assert time.monotonic() - start < 10  # FAST_RETRY's 2 s deadline, plus slack
    assert str(folder / "config.json") in str(info.value)
    assert isinstance(info.value.__cause__, SourceUnavailableError)
    assert not (folder / "config.json").exists()  # the changed copy is not left to be read


@pytest.mark.parametrize(
    "damage",
    ["missing", "not JSON", "older format", "other revision", "other size"],
)
def test_a_copy_without_a_matching_record_is_reused_only_if_it_matches_the_hubs_sha256(
    damage, open_hub, hub: HubServer, tmp_path: Path
):
    fill(open_hub(), tmp_path / "cache")
    folder = tmp_path / "cache" / cache_key(open_hub())
    for name in (SHARD, "config.json"):
        path = folder / f"{name}.sha256"
        record = json.loads(path.read_text())
        if damage == "missing":
            path.unlink()
        elif damage == "not JSON":
            path.write_text("{ not json")
        elif damage == "older format":
            path.write_text(record["sha256"])  # what otfload wrote before records
        else:
            record["revision" if damage == "other revision" else "size"] = "0" * 40 if damage == "other revision" else 1
            path.write_text(json.dumps(record))
    hub.log.clear()
    again = fill(open_hub(), tmp_path / "cache")
    assert again.fetched == ["config.json"]  # no published hash: an unrecorded copy is never trusted
    assert SHARD in again.reused  # hashed once against the Hub's sha256, then recorded again
    assert [r.path.rsplit("/", 1)[1] for r in hub.requests("GET", "/resolve/")] == ["config.json"]
    assert Record.loads((folder / f"{SHARD}.sha256").read_text()) is not None
    assert entries(folder) == FILES


# --- killed fills ----------------------------------------------------------------------------------


def test_the_temporary_of_a_fill_killed_with_sigkill_is_removed_by_the_next_fill(
    hub: HubServer, hub_repo: str, tmp_path: Path
):
    hub.faults.delay_s = 0.05  # 4 KiB windows: the 70 kB shard takes ~18 slow requests
    spec = {"mode": "fill", "local_devices": 1, "source": hub_repo, "window_bytes": 4096,
            "source_options": {"endpoint": hub.url, "cache_dir": str(tmp_path / "hf")},
            "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    [proc] = start_workers(spec, 1, tmp_path / "out")
    try:
        deadline = time.monotonic() + KILL_DEADLINE_S
        while not any(p.stat().st_size > 0 for p in (tmp_path / "cache").rglob(".*.partial-*")):
            assert proc.poll() is None and time.monotonic() < deadline, "the fill never started writing"
            time.sleep(0.02)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)  # reaped, its output pipe closed
    partials = sorted(str(p) for p in (tmp_path / "cache").rglob(".*.partial-*"))
    assert partials and all(f"-{proc.pid}-" in p for p in partials)  # each says whose it is

    hub.reset()
    from otfload.sources.hub import HubSource

    rerun = fill(HubSource(hub_repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=FAST_RETRY), tmp_path / "cache")
    assert sorted(rerun.orphans_removed) == partials
    assert not any(".partial-" in k for k in tree(tmp_path / "cache"))
    assert entries(tmp_path / "cache" / cache_key(rerun.source)) == FILES
