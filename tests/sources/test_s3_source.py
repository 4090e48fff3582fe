"""s3:// against a real S3-compatible server: moto in server mode on 127.0.0.1, no mock objects.

The server runs in its own process for the session (``tests/servers/s3_server.py``); where a test
counts bytes or needs a misbehaving server, the real fault-injecting proxy of the gs:// tests stands
in front of it (``tests/servers/fault_proxy.py``, matching this bucket's object paths): it relays
moto's own answers, counts the object bytes it relayed, and shifts, drops, stalls or fails them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.cache import ShardCache
from otfload.errors import (
    SourceError,
    SourceNotFoundError,
    SourcePermissionError,
    SourceProtocolError,
    SourceTimeoutError,
    SourceUnavailableError,
    TruncatedFileError,
)
from otfload.index.checkpoint import open_index
from otfload.place.loader import execute_plan
from otfload.sources import open_source
from otfload.sources.base import read_bytes
from otfload.sources.fetch_threads import MAX_REQUESTS_IN_FLIGHT
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.retry import RetryPolicy
from tests.servers.fault_proxy import FaultProxy
from tests.servers.net import free_port
from tests.servers.s3_server import S3Server
from tests.sources.conftest import FAST_RETRY
from tests.sources.test_fsspec_source import CHECKPOINT_FILES, SHARD, check_reads
from tests.sources.test_hostile_network import (
    ALWAYS,
    DRIP_S,
    LENGTH,
    OFFSET,
    RETRYING,
    TIGHT,
    Row,
    check_row,
    knobs,
)

BUCKET = "otfload-s3"
FIRST = CHECKPOINT_FILES[1]
SETTLE_S = 5.0  # the proxy counts a body after relaying it: wait this long at most for the count to settle


def s3_source(url: str, endpoint: str, retry: RetryPolicy, **kw) -> FsspecSource:
    return FsspecSource(url, S3Server.options_for(endpoint), retry=retry, **kw)


def warm(url: str, endpoint: str, *policies: RetryPolicy) -> None:
    """Build the S3 client that sources of each policy share at ``endpoint`` (fsspec keeps one per set of
    options, and the policy's idle timeout is one), with time to do it: on a busy machine, building
    botocore's S3 client takes longer than one attempt of TIGHT or of the fast policy."""
    for policy in policies:
        s3_source(url, endpoint, dataclasses.replace(policy, attempt_timeout_s=30, deadline_s=30))


@pytest.fixture(scope="module")
def s3_url(s3_server: S3Server, checkpoint: Path) -> str:
    url = s3_server.upload_dir(checkpoint, BUCKET, "models/tiny")
    warm(url, s3_server.url, FAST_RETRY)
    return url


@pytest.fixture(scope="module")
def proxy(s3_server: S3Server, s3_url) -> Iterator[FaultProxy]:
    """The fault proxy in front of moto; faults and counts apply to object reads of ``BUCKET``."""
    with FaultProxy(s3_server.url, match=f"/{BUCKET}/") as proxy:
        warm(s3_url, proxy.url, TIGHT, FAST_RETRY)
        yield proxy


def settled(count, want: int) -> int:
    end = time.monotonic() + SETTLE_S
    while count() < want and time.monotonic() < end:
        time.sleep(0.02)
    return count()


def test_s3_listing_and_range_reads(s3_url, s3_server: S3Server, checkpoint, fast_retry):
    check_reads(s3_source(s3_url, s3_server.url, fast_retry), checkpoint)
    src = open_source(s3_url.replace("s3://", "s3a://"), storage_options=s3_server.storage_options, retry=fast_retry)
    assert isinstance(src, FsspecSource) and src.list_files() == CHECKPOINT_FILES


def test_every_read_is_one_checked_range_request(s3_url, proxy: FaultProxy, checkpoint, fast_retry):
    src = s3_source(s3_url, proxy.url, fast_retry)
    proxy.reset()
    data = (checkpoint / SHARD).read_bytes()
    assert read_bytes(src, SHARD, OFFSET, LENGTH) == data[OFFSET : OFFSET + LENGTH]
    gets = [r for r in proxy.requests(f"/{BUCKET}/") if r.method == "GET"]
    assert [r.range for r in gets] == [f"bytes={OFFSET}-{OFFSET + LENGTH - 1}"]
    assert settled(lambda: proxy.body_bytes, LENGTH) == LENGTH


class SmallChunkS3(FsspecSource):
    chunk_bytes = 32 << 10  # a 512 KiB read: 16 requests


def test_every_request_slot_has_a_connection(s3_url, proxy: FaultProxy, checkpoint, fast_retry):
    """All MAX_REQUESTS_IN_FLIGHT requests of a source are in flight together, not botocore's
    default of 10 connections: the proxy answers none until all 16 have arrived. (Attempts get time
    to open 16 connections on a busy machine: what is counted is connections, not speed.)"""
    patient = dataclasses.replace(fast_retry, attempt_timeout_s=15.0, deadline_s=60.0)
    src = SmallChunkS3(s3_url, S3Server.options_for(proxy.url), retry=patient)
    proxy.reset()
    proxy.faults.gather = MAX_REQUESTS_IN_FLIGHT
    length = MAX_REQUESTS_IN_FLIGHT * SmallChunkS3.chunk_bytes
    assert read_bytes(src, SHARD, 0, length) == (checkpoint / SHARD).read_bytes()[:length]
    assert proxy.peak_in_flight >= MAX_REQUESTS_IN_FLIGHT and proxy.gather_missed == 0
    assert len(proxy.requests(f"/{BUCKET}/")) == MAX_REQUESTS_IN_FLIGHT  # none waited out its attempt


@pytest.mark.parametrize("url", ["s3://no-such-bucket/x", f"s3://{BUCKET}/models/none"])
def test_missing_bucket_or_prefix(s3_url, s3_server: S3Server, url, fast_retry):
    with pytest.raises(SourceNotFoundError, match=url):
        s3_source(url, s3_server.url, fast_retry)


@pytest.mark.usefixtures("s3_url")  # its client warmed
def test_object_cut_short_or_deleted_after_listing(s3_server: S3Server, checkpoint, fast_retry):
    url = s3_server.upload_dir(checkpoint, BUCKET, "changing")
    src = s3_source(url, s3_server.url, fast_retry)
    data = (checkpoint / SHARD).read_bytes()
    with pytest.raises(TruncatedFileError, match=SHARD):
        src.read_into(SHARD, len(data) - 2, memoryview(bytearray(4)))  # past the listed end: nothing sent
    fs = s3_server.filesystem()
    fs.pipe_file(f"{BUCKET}/changing/{SHARD}", data[: len(data) // 2])
    with pytest.raises(SourceProtocolError, match=rf"says the file has {len(data) // 2} bytes, not {len(data)}"):
        read_bytes(src, SHARD, 0, 100)  # the Content-Range names the object's new size
    start = time.monotonic()
    with pytest.raises(SourceError, match="HTTP 416") as e:
        read_bytes(src, SHARD, len(data) - 100, 100)  # past the new end: moto answers InvalidRange
    assert not isinstance(e.value, SourceUnavailableError)  # permanent: not retried until the deadline
    assert time.monotonic() - start < fast_retry.deadline_s
    fs.rm_file(f"{BUCKET}/changing/{FIRST}")
    with pytest.raises(SourceNotFoundError, match=f"{url}: {FIRST}"):
        read_bytes(src, FIRST, 0, 8)


@pytest.mark.usefixtures("s3_url")
def test_a_truncated_shard_is_a_typed_error(s3_server: S3Server, checkpoint, tmp_path, fast_retry):
    cut = tmp_path / "cut"
    shutil.copytree(checkpoint, cut)
    data = (cut / SHARD).read_bytes()
    (cut / SHARD).write_bytes(data[:-100])
    src = s3_source(s3_server.upload_dir(cut, BUCKET, "cut"), s3_server.url, fast_retry)
    with pytest.raises(TruncatedFileError, match=SHARD):
        open_index(src, require_config=False)


def test_missing_credentials_are_a_permission_error(s3_url, s3_server: S3Server, fast_retry, monkeypatch, tmp_path):
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata service to ask
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(SourcePermissionError, match=f"{s3_url}: no S3 credentials found"):
        FsspecSource(s3_url, {"endpoint_url": s3_server.url, "client_kwargs": {"region_name": "us-east-1"}},
                     retry=fast_retry)  # fmt: skip


def test_unreachable_endpoint_fails_quickly(fast_retry):
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match=f"s3://{BUCKET}/m"):
        s3_source(f"s3://{BUCKET}/m", f"http://127.0.0.1:{free_port()}", fast_retry)  # nothing listens there
    assert time.monotonic() - start < 4.0  # deadline 2 s + one attempt of 1 s


def test_server_gone_after_opening(checkpoint, fast_retry):
    with S3Server() as server:
        url = server.upload_dir(checkpoint, "gone", "m")
        warm(url, server.url, fast_retry)
        src = s3_source(url, server.url, fast_retry)
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match=f"s3://gone/m: {SHARD}"):
        read_bytes(src, SHARD, 0, 100)
    assert time.monotonic() - start < 4.0


S3_ROWS = [
    Row("drip-forever", knobs(drip_next=ALWAYS, drip_interval_s=DRIP_S), SourceTimeoutError),
    Row("stall-forever", knobs(stall_next=ALWAYS), SourceTimeoutError),
    Row("stall-once-then-retried", knobs(stall_next=1), None, retry=RETRYING),
    Row("5xx-burst-shorter-than-retries", knobs(fail_next=2, fail_status=503), None, retry=RETRYING),
    Row("5xx-forever", knobs(fail_next=ALWAYS, fail_status=503), SourceUnavailableError, retry=RETRYING),
    Row("shifted-content-range", knobs(shift_range_next=ALWAYS), SourceProtocolError),
    Row("200-with-whole-object", knobs(drop_range_next=ALWAYS), None),
]


@pytest.mark.parametrize("row", S3_ROWS, ids=lambda r: r.name)
def test_s3_range_reads_through_fault_proxy(row: Row, s3_url, proxy: FaultProxy, checkpoint):
    src = s3_source(s3_url, proxy.url, row.retry)
    proxy.reset()
    want = (checkpoint / SHARD).read_bytes()[OFFSET : OFFSET + LENGTH]
    check_row(row, src, proxy.faults, want, s3_url)
    gets = [r for r in proxy.requests(f"/{BUCKET}/") if r.method == "GET"]
    assert any(r.fault for r in gets)  # the fault really was served
    if row.name == "5xx-forever":  # one request per attempt of the policy: s3fs and botocore do not retry inside
        assert len(gets) == RETRYING.attempts
    if row.error is SourceProtocolError:
        assert len(gets) == 1  # never retried: the answer is wrong, not late


# --- whole loads ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama")[0]


@pytest.fixture(scope="module")
def local_arrays(llama, mesh_2x4) -> dict[str, np.ndarray]:
    _, plan, local = otfload.plan_model(llama, mesh=mesh_2x4)
    with contextlib.closing(local):
        arrays, _ = execute_plan(plan, local)
    return {name: np.asarray(a) for name, a in arrays.items()}


def assert_same(got: dict, want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys() and want
    for name, array in want.items():
        np.testing.assert_array_equal(np.asarray(got[name]), array, err_msg=name)


def test_load_equals_local_and_the_report_counts_what_the_server_sent(
    s3_server: S3Server, proxy: FaultProxy, llama, local_arrays, mesh_2x4, fast_retry, closing
):
    url = s3_server.upload_dir(llama, BUCKET, "llama")
    proxy.reset()  # no fault left armed
    source = closing(s3_source(url, proxy.url, fast_retry))
    _, plan, _ = otfload.plan_model(source, mesh=mesh_2x4)  # headers: before the count starts
    proxy.reset()
    arrays, report = execute_plan(plan, source, workers=4)
    assert_same(arrays, local_arrays)
    gets = [r for r in proxy.requests(f"/{BUCKET}/llama/") if r.method == "GET"]
    assert all(r.range and r.range.startswith("bytes=") for r in gets)  # range reads only, no whole object
    assert report.requests == len(gets)
    assert report.bytes_read == settled(lambda: proxy.body_bytes, report.bytes_read)  # every byte moto sent
    assert report.bytes_planned <= report.bytes_read <= 1.1 * report.bytes_planned


@pytest.mark.usefixtures("s3_url")
def test_from_pretrained_through_a_shard_cache_in_an_s3_prefix(
    s3_server: S3Server, llama, mesh_2x4, fast_retry, closing
):
    url = s3_server.upload_dir(llama, BUCKET, "llama-cached")
    cache_url, options = f"s3://{BUCKET}/cache", s3_server.storage_options
    model = otfload.from_pretrained(url, storage_options=options, retry=fast_retry, shard_cache=cache_url,
                                    shard_cache_options=options, mesh=mesh_2x4)  # fmt: skip
    want = flat_params(otfload.from_pretrained(llama, mesh=mesh_2x4))
    got = flat_params(model)
    assert got.keys() == want.keys() and want
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array, err_msg=name)
    files = sorted(p.name for p in llama.iterdir() if p.suffix in (".json", ".safetensors"))
    cached = [p.rsplit("/", 1)[1] for p in s3_server.filesystem().find(cache_url.removeprefix("s3://"))]
    assert sorted(n for n in cached if not n.endswith(".sha256")) == files  # no temporary left behind
    again = closing(ShardCache(s3_source(url, s3_server.url, fast_retry), cache_url, storage_options=options))
    assert again.fetched == [] and sorted(again.reused) == files  # verified, not fetched again


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
