"""Large remote ranges are fetched as concurrent chunks (issue 20): exact bytes, counted by the server.

Real servers on 127.0.0.1, no mocks: the Hub-protocol server for ``hub:``, and the real
fake-gcs-server for ``gs://`` and moto's S3 for ``s3://`` behind the fault proxy (it counts the object
reads and their bytes). The servers' ``gather`` knob holds answers until that many requests are in
flight at once, so "the chunks are in flight together" is proved by the server, not by a clock; a
sibling that was cancelled shows as a stalled answer its client hung up on (``abandoned``), which
the server counts.
"""

from __future__ import annotations

import contextlib
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np
import pytest

import otfload
from otfload.accounting.meter import FetchMeter, metering
from otfload.accounting.requests import MIN_CHUNK_BYTES, READ_SPLIT, REMOTE_CHUNK_BYTES, remote_chunk_bytes
from otfload.errors import LoadCancelled, SourceProtocolError
from otfload.place.loader import execute_plan
from otfload.plan.planner import LoadPlan
from otfload.sources.base import RangeRead, Source
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.http_body import BODY_PIECE_BYTES
from otfload.sources.hub import HubSource
from otfload.sources.retry import CancelToken, RequestSlots, RetryPolicy, cancel_scope
from tests.servers.fault_proxy import FaultProxy
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import STALL_HOLD_S, HubServer
from tests.servers.s3_server import S3Server

REPO, BUCKET, PREFIX = "org/chunked", "chunked", "m"
FILE = "data.safetensors"  # raw bytes: range reads never parse them
# Large enough for 5 chunks of the real, largest chunk size from an odd offset; small enough to write quickly.
BIG_BYTES = 4 * REMOTE_CHUNK_BYTES + REMOTE_CHUNK_BYTES // 2 + 4099
SMALL_CHUNK = 64 << 10  # the small-chunk sources below: many chunks from a few MiB
# Fast retries; an idle bound above the servers' stall hold, so a stalled sibling that was not
# cancelled outlives the server's patience (the server gives up first and does not count it).
RETRY = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05, read_timeout_s=2 * STALL_HOLD_S)
SETTLE_S = 5.0  # the server notices a client hanging up within its 50 ms poll; this bounds the wait


class SmallChunkHub(HubSource):
    chunk_bytes = SMALL_CHUNK
    max_requests_in_flight = 2


class SmallChunkFsspec(FsspecSource):
    chunk_bytes = SMALL_CHUNK
    max_requests_in_flight = 2


class ThreeSlotHub(SmallChunkHub):
    max_requests_in_flight = 3


class ThreeSlotFsspec(SmallChunkFsspec):
    max_requests_in_flight = 3


@dataclass
class Remote:
    """One remote store under test, with what its server counted: object GETs and their body bytes."""

    name: str
    open: Callable[[type | None], Source]  # a source class (None: the default one) -> an open source
    reset: Callable[[], None]
    gets: Callable[[], list[tuple[int, int]]]  # [(first, last)] of the ranged object GETs served
    body_bytes: Callable[[], int]
    faults: Callable[[], object]  # the server's knobs (gather, stall_next, ...)
    peak_in_flight: Callable[[], int]
    gather_missed: Callable[[], int]
    abandoned: Callable[[], int]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    root = tmp_path_factory.mktemp("chunked")
    payload = np.random.default_rng(20).bytes(BIG_BYTES)
    (root / FILE).write_bytes(payload)
    (root / "config.json").write_text("{}")
    return root, payload


def _ranges(headers: list[str | None]) -> list[tuple[int, int]]:
    out = []
    for h in headers:
        assert h is not None and h.startswith("bytes=")
        first, last = h.removeprefix("bytes=").split("-")
        out.append((int(first), int(last)))
    return sorted(out)


@pytest.fixture(scope="module")
def hub_repo(hub_server: HubServer, data) -> str:
    return hub_server.add_repo(REPO, data[0])


@pytest.fixture(scope="module")
def gcs_proxy(gcs_server: GcsServer, data) -> Iterator[FaultProxy]:
    gcs_server.upload_dir(data[0], BUCKET, PREFIX)
    with FaultProxy(gcs_server.url) as proxy:
        yield proxy


@pytest.fixture(scope="module")
def s3_proxy(s3_server: S3Server, data) -> Iterator[FaultProxy]:
    s3_server.upload_dir(data[0], BUCKET, PREFIX)
    with FaultProxy(s3_server.url, match=f"/{BUCKET}/{PREFIX}/") as proxy:
        yield proxy


@pytest.fixture(params=["hub", "gs", "s3"])
def remote(request, tmp_path: Path) -> Remote:
    if request.param == "hub":
        hub: HubServer = request.getfixturevalue("hub")
        repo = request.getfixturevalue("hub_repo")

        def open_hub(cls: type | None) -> Source:
            return (cls or HubSource)(repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=RETRY)

        return Remote(
            "hub", open_hub, hub.reset,
            lambda: _ranges([r.range for r in hub.requests("GET", f"/resolve/{hub.commit(repo)}/{FILE}")]),
            lambda: hub.body_bytes, lambda: hub.faults, lambda: hub.peak_in_flight,
            lambda: hub.gather_missed, lambda: hub.abandoned,
        )  # fmt: skip
    proxy: FaultProxy = request.getfixturevalue(f"{'gcs' if request.param == 'gs' else 's3'}_proxy")
    options = {"endpoint_url": proxy.url, "token": "anon"} if request.param == "gs" else S3Server.options_for(proxy.url)

    def open_bucket(cls: type | None) -> Source:
        return (cls or FsspecSource)(f"{request.param}://{BUCKET}/{PREFIX}", options, retry=RETRY)

    return Remote(
        request.param, open_bucket, proxy.reset,
        lambda: _ranges([r.range for r in proxy.requests(proxy.match) if FILE in r.target and r.method == "GET"]),
        lambda: proxy.body_bytes, lambda: proxy.faults, lambda: proxy.peak_in_flight,
        lambda: proxy.gather_missed, lambda: proxy.abandoned,
    )  # fmt: skip


def _settled(count: Callable[[], int], want: int) -> int:
    """``count()`` once it reaches ``want`` (or SETTLE_S has passed: then the count as it is)."""
    end = time.monotonic() + SETTLE_S
    while count() < want and time.monotonic() < end:
        time.sleep(0.02)
    return count()


def test_a_large_range_is_read_as_concurrent_chunks_of_the_exact_bytes(remote: Remote, data):
    _, payload = data
    src = remote.open(None)
    offset, length = 1001, BIG_BYTES - 1001 - 7
    assert remote_chunk_bytes(length) == REMOTE_CHUNK_BYTES  # large enough for the largest chunks
    remote.reset()
    remote.faults().gather = 5  # answered only once all five chunks are in flight together
    out = bytearray(length)
    meter = FetchMeter()
    with metering(meter):
        src.read_into(FILE, offset, memoryview(out))
    assert out == payload[offset : offset + length]
    gets = remote.gets()
    assert len(gets) == 5  # ceil(length / REMOTE_CHUNK_BYTES)
    assert all(last - first + 1 <= REMOTE_CHUNK_BYTES for first, last in gets)
    assert [g[0] for g in gets] == [offset] + [last + 1 for _, last in gets[:-1]]  # disjoint, in order
    assert gets[-1][1] == offset + length - 1
    assert remote.gather_missed() == 0 and remote.peak_in_flight() >= 5
    assert _settled(remote.body_bytes, length) == length  # not a byte fetched twice (counted after sending)
    assert (meter.requests, meter.bytes) == (5, length)  # the load's report counts what the server did


def test_a_mid_size_range_is_still_split_for_concurrency(remote: Remote, data):
    """6 MB (one layer's matrix of a stacked leaf) goes as READ_SPLIT pieces, not one 50 MB/s stream."""
    _, payload = data
    src = remote.open(None)
    length = 6_000_000
    remote.reset()
    remote.faults().gather = READ_SPLIT
    out = bytearray(length)
    src.read_into(FILE, 3, memoryview(out))
    assert out == payload[3 : 3 + length]
    gets = remote.gets()
    assert len(gets) == READ_SPLIT and remote.gather_missed() == 0
    assert {last - first + 1 for first, last in gets} == {length // READ_SPLIT}
    small = bytearray(MIN_CHUNK_BYTES + 1)  # not split below MIN_CHUNK_BYTES: two requests, not four
    remote.reset()
    src.read_into(FILE, 0, memoryview(small))
    assert small == payload[: len(small)] and len(remote.gets()) == 2


def test_requests_in_flight_are_bounded_per_source_across_threads(remote: Remote, data):
    _, payload = data
    src = remote.open(SmallChunkHub if remote.name == "hub" else SmallChunkFsspec)
    remote.reset()
    remote.faults().gather = 2  # proves the bound is reached: two are in flight together
    spans = [(0, 9 * SMALL_CHUNK), (10 * SMALL_CHUNK, 7 * SMALL_CHUNK + 5), (20 * SMALL_CHUNK + 3, 4 * SMALL_CHUNK)]
    outs = [bytearray(n) for _, n in spans]
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            src.read_into(FILE, spans[i][0], memoryview(outs[i]))
        except BaseException as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(spans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for (offset, n), out in zip(spans, outs, strict=True):
        assert out == payload[offset : offset + n]
    assert len(remote.gets()) == 9 + 8 + 4
    assert remote.peak_in_flight() == 2 and remote.gather_missed() == 0  # at most, and at least, 2


def test_read_many_fetches_chunks_and_the_meter_matches_the_server(remote: Remote, data):
    _, payload = data
    src = remote.open(SmallChunkHub if remote.name == "hub" else SmallChunkFsspec)
    remote.reset()
    spans = [(5, 100), (300, 3 * SMALL_CHUNK), (8 * SMALL_CHUNK, 2 * SMALL_CHUNK + 1)]  # first two: one run
    outs = [bytearray(n) for _, n in spans]
    meter = FetchMeter()
    with metering(meter):
        src.read_many([RangeRead(FILE, o, memoryview(b)) for (o, _), b in zip(spans, outs, strict=True)])
    for (offset, n), out in zip(spans, outs, strict=True):
        assert out == payload[offset : offset + n]
    gets = remote.gets()
    assert all(last - first + 1 <= SMALL_CHUNK for first, last in gets)
    assert len(gets) == 4 + 3  # [5, 300 + 3 chunks) in 4 chunk-sized runs; 2 chunks + 1 byte in 3
    # The server counts a body once it has been sent: the client can finish reading first.
    assert (meter.requests, meter.bytes) == (len(gets), _settled(remote.body_bytes, meter.bytes))


def test_a_failed_chunk_cancels_its_siblings_and_is_raised_typed(remote: Remote, data):
    src = remote.open(ThreeSlotHub if remote.name == "hub" else ThreeSlotFsspec)  # 3 chunks in flight
    remote.reset()
    faults = remote.faults()
    faults.gather = 3
    if remote.name == "hub":  # every answer stalls half-way; one also names other bytes
        faults.stall_next, faults.range_fault, faults.range_fault_next = 3, "shift", 1
        siblings = 3  # the shifted answer stalls too, and its client leaves it at once
    else:  # two answers stall half-way, one names other bytes
        faults.stall_next, faults.shift_range_next = 2, 1
        siblings = 2
    with pytest.raises(SourceProtocolError, match="Content-Range"):
        src.read_into(FILE, 0, memoryview(bytearray(3 * SMALL_CHUNK)))
    assert len(remote.gets()) == 3  # nothing retried: a wrong answer is permanent, the rest cancelled
    # Not cancelled, a stalled sibling would wait for RETRY's idle bound, past the server's own hold
    # (then the server, not the client, ends it, and it is not counted).
    assert _settled(remote.abandoned, siblings) == siblings


def test_a_transient_failure_in_one_chunk_refetches_only_what_is_missing(remote: Remote, data):
    _, payload = data
    src = remote.open(SmallChunkHub if remote.name == "hub" else SmallChunkFsspec)
    remote.reset()
    if remote.name == "hub":
        remote.faults().truncate_next = 1  # half a chunk, then a clean close: the retry asks for the rest
    else:
        remote.faults().fail_next = 1  # a 503: the chunk is asked again
    out = bytearray(5 * SMALL_CHUNK)
    src.read_into(FILE, 77, memoryview(out))
    assert out == payload[77 : 77 + len(out)]
    assert len(remote.gets()) == 5 + 1
    # gs:// and s3://: the failed chunk sent nothing. The Hub keeps what arrived, but for the piece in progress
    # when the connection breaks with an error (less than BODY_PIECE_BYTES): at most half a chunk.
    refetched = _settled(remote.body_bytes, len(out)) - len(out)  # the server counts after sending
    assert 0 <= refetched <= (SMALL_CHUNK // 2 if remote.name == "hub" else 0)


def test_a_broken_hub_body_resumes_after_its_whole_pieces(hub, hub_repo, data, tmp_path):
    """A chunk cut half-way keeps what arrived (at least its whole pieces): its retry asks for the
    rest only, and less than one piece is fetched twice."""
    src = HubSource(hub_repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=RETRY)
    hub.reset()
    hub.faults.truncate_next = 1
    chunk = 3 * BODY_PIECE_BYTES
    out = bytearray(4 * chunk)  # READ_SPLIT requests of 3 pieces each
    src.read_into(FILE, 0, memoryview(out))
    src.close()
    assert out == data[1][: len(out)]
    starts = sorted(int(r.range.removeprefix("bytes=").split("-")[0]) for r in hub.requests("GET", "/resolve/"))
    resumed = [s % chunk for s in starts if s % chunk]
    assert len(starts) == 5 and len(resumed) == 1
    # 1.5 pieces arrived: all kept when the body just ends, the whole one at least
    assert BODY_PIECE_BYTES <= resumed[0] <= chunk // 2
    sent = len(out) + chunk // 2 - resumed[0]
    assert _settled(lambda: hub.body_bytes, sent) == sent


def test_a_large_range_is_never_staged_whole(remote: Remote, data):
    """Memory in flight is the chunks, not the range: 2 of 64 KiB in flight for 2 MiB read."""
    _, payload = data
    src = remote.open(SmallChunkHub if remote.name == "hub" else SmallChunkFsspec)
    out = bytearray(32 * SMALL_CHUNK)
    tracemalloc.start()
    try:
        src.read_into(FILE, 11, memoryview(out))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert out == payload[11 : 11 + len(out)]
    assert peak < len(out) // 2  # one request for the range holds its whole body (gcsfs) at once


def test_request_slots_stop_waiting_when_the_load_is_cancelled():
    slots = RequestSlots(1)
    token = CancelToken()
    seen: list[BaseException] = []

    def wait_for_slot() -> None:
        with cancel_scope(token):
            try:
                with slots.hold("gs://b/m: f"):
                    pass
            except LoadCancelled as e:
                seen.append(e)

    with slots.hold("holder"):
        waiter = threading.Thread(target=wait_for_slot)
        waiter.start()
        token.cancel()
        waiter.join(SETTLE_S)
        assert not waiter.is_alive()
    assert len(seen) == 1 and "gs://b/m: f" in str(seen[0])
    with slots.hold("free again"):  # the cancelled waiter took no slot
        pass


def test_a_leaf_read_whole_from_the_hub_arrives_in_chunks(hub: HubServer, tiny_checkpoints, tmp_path, closing):
    """One device: each leaf's box is one contiguous run of its tensor, read as chunk-sized requests."""
    path, _ = tiny_checkpoints("llama")
    repo = hub.add_repo("org/chunked-llama", path)
    mesh = otfload.make_mesh({"fsdp": 1}, jax.devices()[:1])
    source = closing(SmallChunkHub(repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=RETRY))
    _, plan, _ = otfload.plan_model(source, mesh=mesh)  # headers: before the count starts
    hub.reset()
    got, report = execute_plan(plan, source, workers=4)
    gets = _ranges([r.range for r in hub.requests("GET", "/resolve/")])
    assert max(last - first + 1 for first, last in gets) <= SMALL_CHUNK
    assert sum(last - first + 1 == SMALL_CHUNK for first, last in gets) >= 2  # leaves over several chunks
    assert (report.requests, report.bytes_read) == (len(gets), _settled(lambda: hub.body_bytes, report.bytes_read))
    _, local_plan, local = otfload.plan_model(path, mesh=mesh)
    want, _ = execute_plan(local_plan, closing(local))
    assert got.keys() == want.keys() and got
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


def test_a_stacked_leaf_has_every_layers_requests_in_flight_together(hub: HubServer, tiny_checkpoints, tmp_path):
    """One builder thread, one device: the 3 layers of each scanned leaf are one request each, and the
    server answers none until all 3 are in flight (``gather``): read one after another, each would
    wait out the server's gather timeout and count as missed."""
    path, _ = tiny_checkpoints("llama")
    repo = hub.add_repo("org/stacked-llama", path)
    mesh = otfload.make_mesh({"fsdp": 1}, jax.devices()[:1])
    source = HubSource(repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=RETRY)
    _, plan, _ = otfload.plan_model(source, mesh=mesh, scan_layers=True)
    stacked = LoadPlan({path: p for path, p in plan.leaves.items() if p.stack_axes == ("layer",)})
    assert len(stacked.leaves) >= 5 and all(p.stack_shape == (3,) for p in stacked.leaves.values())
    hub.reset()
    hub.faults.gather = 3
    got, report = execute_plan(stacked, source, workers=1)
    assert hub.gather_missed == 0 and hub.peak_in_flight >= 3
    assert report.requests == len(hub.requests("GET", "/resolve/")) >= 3 * len(stacked.leaves)
    _, local_plan, local = otfload.plan_model(path, mesh=mesh, scan_layers=True)
    with contextlib.closing(local):
        want, _ = execute_plan(LoadPlan({k: local_plan.leaves[k] for k in stacked.leaves}), local)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    source.close()
