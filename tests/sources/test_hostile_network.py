"""Hostile and faulty servers, table-driven: every fault ends in the exact bytes or a typed error, in bounded time.

Real servers on 127.0.0.1, no mocks: the Hub-protocol server (``tests/servers/hub_server.py``) for
the Hub and for ``http://`` fsspec URLs, and the real fake-gcs-server behind a real fault-injecting
HTTP proxy (``tests/servers/fault_proxy.py``) for ``gs://``. Each row names the fault, the outcome
(``None``: the bytes asked for, exactly) and a time bound derived from the tight policy below.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from otfload.errors import (
    ChecksumMismatchError,
    SourceError,
    SourceProtocolError,
    SourceTimeoutError,
    SourceUnavailableError,
)
from otfload.options import resolve_options
from otfload.sources import open_source
from otfload.sources.base import read_bytes
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.hub import HubSource
from otfload.sources.retry import TIMEOUT_ENV, Deadline, RetryPolicy
from tests.servers.fault_proxy import FaultProxy, ProxyFaults
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import METADATA_FAULTS, RANGE_FAULTS, Faults, HubServer

REPO = "org/hostile"
SHARD = "model-00002-of-00002.safetensors"
OFFSET, LENGTH = 1000, 5000  # a range inside the shard, not at its start (a 200 must be sliced)
DRIP_S = 0.05  # one byte per 50 ms: fast enough to beat the idle timeout, too slow for the attempt budget

# Tight bounds so that every row ends in about a second: 3 attempts, each at most 0.5 s (plus bytes at
# 1 MB/s), an idle timeout of 0.3 s, and no new attempt after 1 s.
TIGHT = RetryPolicy(
    attempts=3,
    base_delay_s=0.01,
    max_delay_s=0.05,
    deadline_s=1.0,
    attempt_timeout_s=0.5,
    read_timeout_s=0.3,
    min_rate_bytes_s=1e6,
)
# Worst case of TIGHT: attempts start until deadline_s, the last one runs its full budget, plus
# scheduling noise on a loaded 2-core CI machine.
TIGHT_BOUND_S = TIGHT.deadline_s + TIGHT.attempt_budget(LENGTH) + 1.5
# For the rows whose outcome needs a second (or every) attempt: TIGHT's attempts, but new ones may start
# until 3 s (on a loaded machine a retry can begin after TIGHT's 1 s, turning a recovery into a timeout or
# leaving attempts unmade); such a row still ends within TIGHT_BOUND_S.
RETRYING = dataclasses.replace(TIGHT, deadline_s=3.0)


@dataclass(frozen=True)
class Row:
    """One hostile case: ``faults`` are the server's knobs; ``error`` the typed outcome (None: exact bytes);
    ``retry`` the policy of the source that reads it."""

    name: str
    faults: dict[str, object]
    error: type[Exception] | None
    bound_s: float = TIGHT_BOUND_S
    retry: RetryPolicy = TIGHT

    def arm(self, faults: Faults | ProxyFaults) -> None:
        for k, v in self.faults.items():
            assert hasattr(faults, k), k
            setattr(faults, k, v)


def knobs(**values: object) -> dict[str, object]:
    return values


ALWAYS = 10**6  # a counter that never runs out within a test

# Range reads (Hub resolve URLs, and the same server as an http:// fsspec URL).
RANGE_ROWS = [
    Row("drip-forever", knobs(drip_next=ALWAYS, drip_interval_s=DRIP_S), SourceTimeoutError),
    Row("drip-once-then-resumed", knobs(drip_next=1, drip_interval_s=DRIP_S), None, retry=RETRYING),
    Row("stall-forever", knobs(stall_next=ALWAYS), SourceTimeoutError),
    Row("stall-once-then-resumed", knobs(stall_next=1), None, retry=RETRYING),
    Row("short-body-once-then-resumed", knobs(truncate_next=1), None, retry=RETRYING),
    Row("short-body-forever", knobs(truncate_next=ALWAYS), SourceUnavailableError),
    Row("reset-forever", knobs(reset_next=ALWAYS), SourceUnavailableError),
    Row("5xx-burst-shorter-than-retries", knobs(fail_next=2, fail_status=503), None, retry=RETRYING),
    Row("5xx-forever", knobs(fail_next=ALWAYS, fail_status=502), SourceUnavailableError),
    Row("500-forever", knobs(fail_next=ALWAYS, fail_status=500), SourceUnavailableError),
    Row("shifted-content-range", knobs(range_fault="shift", range_fault_next=ALWAYS), SourceProtocolError),
    Row("200-with-whole-file", knobs(range_fault="full", range_fault_next=ALWAYS), None),
    Row("long-body", knobs(range_fault="long", range_fault_next=ALWAYS), SourceProtocolError),
    Row("long-body-chunked", knobs(range_fault="long_chunked", range_fault_next=ALWAYS), SourceProtocolError),
    Row("wrong-total-size", knobs(range_fault="total", range_fault_next=ALWAYS), SourceProtocolError),
    Row("206-without-content-range", knobs(range_fault="missing", range_fault_next=ALWAYS), SourceProtocolError),
    Row("shorter-honest-ranges", knobs(range_fault="cap", range_fault_next=ALWAYS), None),
    Row("lying-content-encoding", knobs(range_fault="gzip", range_fault_next=ALWAYS), SourceProtocolError),
    Row("redirect-loop", knobs(redirect_loop=True), SourceProtocolError),
]


def test_every_range_fault_of_the_server_has_a_row():
    assert {r.faults.get("range_fault") for r in RANGE_ROWS} >= set(RANGE_FAULTS)


@pytest.fixture(scope="module")
def repo(hub_server: HubServer, checkpoint: Path) -> str:
    return hub_server.add_repo(REPO, checkpoint)


@pytest.fixture
def want(checkpoint: Path) -> bytes:
    return (checkpoint / SHARD).read_bytes()[OFFSET : OFFSET + LENGTH]


def open_hub(hub: HubServer, tmp_path: Path, **kw) -> HubSource:
    return HubSource(REPO, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=kw.pop("retry", TIGHT), **kw)


def open_http(hub: HubServer, **kw) -> FsspecSource:
    return FsspecSource(f"{hub.url}/{REPO}/resolve/main", retry=kw.pop("retry", TIGHT), **kw)


def check_row(row: Row, src, arm_on: Faults, want: bytes, url_part: str) -> float:
    """Arm ``row``, read the range, check the outcome; returns the seconds it took."""
    row.arm(arm_on)
    start = time.monotonic()
    if row.error is None:
        assert read_bytes(src, SHARD, OFFSET, LENGTH) == want
    else:
        with pytest.raises(row.error) as e:
            read_bytes(src, SHARD, OFFSET, LENGTH)
        assert type(e.value) is row.error or row.error is SourceUnavailableError
        assert url_part in str(e.value)  # names the source/URL and the file
        if isinstance(e.value, SourceTimeoutError):
            assert SHARD in e.value.url and 0 <= e.value.received < LENGTH
    took = time.monotonic() - start
    assert took < row.bound_s, f"{row.name}: {took:.2f}s > {row.bound_s:.2f}s"
    return took


@pytest.mark.parametrize("row", RANGE_ROWS, ids=lambda r: r.name)
def test_hub_range_reads(row: Row, hub: HubServer, repo, tmp_path, want):
    src = open_hub(hub, tmp_path, retry=row.retry)
    check_row(row, src, hub.faults, want, SHARD)
    if row.error is SourceProtocolError and row.name != "redirect-loop":
        assert len(hub.requests("GET", "/resolve/")) == 1  # never retried: the server's answer is wrong, not late


@pytest.mark.parametrize("row", RANGE_ROWS, ids=lambda r: r.name)
def test_http_fsspec_range_reads(row: Row, hub: HubServer, repo, want):
    src = open_http(hub, retry=row.retry)
    assert src.size(SHARD) == len((hub.root / REPO / SHARD).read_bytes())  # sized by HEAD: the listing has none
    check_row(row, src, hub.faults, want, SHARD)


def test_drip_counts_the_bytes_received_and_names_the_url(hub: HubServer, repo, tmp_path):
    src = open_hub(hub, tmp_path)
    hub.faults.drip_next, hub.faults.drip_interval_s = ALWAYS, DRIP_S
    with pytest.raises(SourceTimeoutError) as e:
        read_bytes(src, SHARD, OFFSET, LENGTH)
    assert e.value.url == f"{hub.url}/{REPO}/resolve/{src.commit}/{SHARD}"
    # each attempt of ~0.5 s gets ~10 bytes at one per 50 ms, and the next resumes after them
    assert 3 <= e.value.received <= 60 and f"{e.value.received} byte(s) received" in str(e.value)
    ranges = [r.range for r in hub.requests("GET", "/resolve/")]
    assert len(set(ranges)) == len(ranges) > 1  # every retry asked only for what was missing


# --- the total deadline (timeout= / OTFLOAD_TIMEOUT) ---------------------------------------------

PATIENT = RetryPolicy(attempts=50, base_delay_s=0.01, max_delay_s=0.05, deadline_s=60, attempt_timeout_s=30)
TIMEOUT_S = 1.0


def assert_deadline_kept(start: float) -> None:
    """The total timeout runs from the source's making (it bounds the whole load, opening included), so
    time from just before it: the error comes at the deadline, not before, and well before PATIENT's
    50 attempts of up to 30 s would end, with the noise margin of ``TIGHT_BOUND_S`` for a loaded machine."""
    took = time.monotonic() - start
    assert TIMEOUT_S <= took < TIMEOUT_S + 1.5, took


@pytest.mark.parametrize("how", ["argument", "env"])
@pytest.mark.parametrize("fault", ["drip", "stall"])
def test_total_timeout_ends_a_patient_policy(hub: HubServer, repo, tmp_path, monkeypatch, how, fault):
    if how == "env":
        monkeypatch.setenv(TIMEOUT_ENV, str(TIMEOUT_S))
    kw = {"timeout": TIMEOUT_S} if how == "argument" else resolve_options(None, {}).source_options()  # the front door
    start = time.monotonic()
    src = open_source(REPO, endpoint=hub.url, cache_dir=tmp_path, retry=PATIENT, **kw)
    setattr(hub.faults, f"{fault}_next", ALWAYS)
    hub.faults.drip_interval_s = DRIP_S
    with pytest.raises(SourceTimeoutError, match=r"timeout of 1s passed with \d+ byte\(s\) received from http") as e:
        read_bytes(src, SHARD, OFFSET, LENGTH)
    assert_deadline_kept(start)
    assert SHARD in e.value.url


def test_total_timeout_bounds_gcs_and_http_fsspec(hub: HubServer, repo, monkeypatch):
    start = time.monotonic()
    src = open_http(hub, retry=PATIENT, timeout=TIMEOUT_S)
    hub.faults.stall_next = ALWAYS
    with pytest.raises(SourceTimeoutError, match="timeout of 1s"):
        read_bytes(src, SHARD, OFFSET, LENGTH)
    assert_deadline_kept(start)


@pytest.mark.parametrize("bad", ["0", "-3", "soon", "inf"])
def test_bad_timeout_values_are_refused(monkeypatch, bad):
    monkeypatch.setenv(TIMEOUT_ENV, bad)
    with pytest.raises(ValueError, match=TIMEOUT_ENV):  # InvalidOptionError is a ValueError
        resolve_options(None, {})
    for value in (0, -1.0, True, "10"):
        with pytest.raises(ValueError, match="timeout"):
            Deadline(value)  # type: ignore[arg-type]


# --- revision metadata -----------------------------------------------------------------------------


@pytest.mark.parametrize("fault", METADATA_FAULTS)
def test_broken_revision_metadata_is_typed(fault, hub: HubServer, repo, tmp_path):
    hub.faults.metadata_fault = fault
    hub.faults.drip_interval_s = DRIP_S
    error = SourceTimeoutError if fault in ("drip", "stall") else SourceProtocolError
    start = time.monotonic()
    with pytest.raises(error) as e:
        open_hub(hub, tmp_path)
    assert time.monotonic() - start < TIGHT_BOUND_S
    assert f"{hub.url}/api/models/{REPO}/revision/main" in str(e.value)  # names the URL
    if fault == "bad_sha":  # never a path in the HF cache
        assert not list((tmp_path / "hf").rglob("evil"))


def test_metadata_5xx_burst_is_retried_then_typed(hub: HubServer, repo, tmp_path):
    hub.faults.fail_next = 2
    assert open_hub(hub, tmp_path).commit == hub.commit(REPO)
    hub.faults.fail_next = ALWAYS
    with pytest.raises(SourceUnavailableError, match="HTTP 503"):
        open_hub(hub, tmp_path)
    assert len(hub.requests("GET", "/api/models/")) == 2 + 1 + TIGHT.attempts


def test_valid_metadata_still_opens(hub: HubServer, repo, tmp_path, checkpoint):
    src = open_hub(hub, tmp_path)
    assert read_bytes(src, SHARD) == (checkpoint / SHARD).read_bytes()
    assert isinstance(SourceProtocolError("x"), SourceError)  # catchable as any source error


# --- gs:// through a fault proxy in front of the real fake-gcs-server -----------------------------

GCS_ROWS = [
    Row("drip-forever", knobs(drip_next=ALWAYS, drip_interval_s=DRIP_S), SourceTimeoutError),
    Row("drip-once-then-retried", knobs(drip_next=1, drip_interval_s=DRIP_S), None, retry=RETRYING),
    Row("stall-forever", knobs(stall_next=ALWAYS), SourceTimeoutError),
    Row("stall-once-then-retried", knobs(stall_next=1), None, retry=RETRYING),
    Row("shifted-content-range", knobs(shift_range_next=ALWAYS), SourceProtocolError),
    Row("200-with-whole-object", knobs(drop_range_next=ALWAYS), None),
]


@pytest.fixture(scope="module")
def gcs_proxy(gcs_server: GcsServer, checkpoint: Path):
    gcs_server.upload_dir(checkpoint, "hostile", "m")
    with FaultProxy(gcs_server.url) as proxy:
        yield proxy


@pytest.mark.parametrize("row", GCS_ROWS, ids=lambda r: r.name)
def test_gcs_range_reads_through_fault_proxy(row: Row, gcs_proxy: FaultProxy, want):
    gcs_proxy.reset()
    src = FsspecSource("gs://hostile/m", {"endpoint_url": gcs_proxy.url, "token": "anon"}, retry=row.retry)
    check_row(row, src, gcs_proxy.faults, want, "gs://hostile/m")
    assert any(r.fault for r in gcs_proxy.requests("alt=media"))  # the fault really was served


def test_gcs_total_timeout(gcs_proxy: FaultProxy, want):
    gcs_proxy.reset()
    start = time.monotonic()
    src = FsspecSource("gs://hostile/m", {"endpoint_url": gcs_proxy.url, "token": "anon"}, retry=PATIENT,
                       timeout=TIMEOUT_S)  # fmt: skip
    gcs_proxy.faults.stall_next = ALWAYS
    with pytest.raises(SourceTimeoutError, match="timeout of 1s") as e:
        read_bytes(src, SHARD, OFFSET, LENGTH)
    assert_deadline_kept(start)
    assert e.value.url == f"gs://hostile/m/{SHARD}"


# --- whole-file downloads (shard_cache=True on one host) -------------------------------------------


def test_download_is_bounded_and_leaves_nothing_behind(hub: HubServer, repo, tmp_path):
    src = open_hub(hub, tmp_path)
    hub.faults.drip_next, hub.faults.drip_interval_s = ALWAYS, DRIP_S
    start = time.monotonic()
    with pytest.raises(SourceTimeoutError):
        src.download(SHARD)
    assert time.monotonic() - start < TIGHT.deadline_s + TIGHT.attempt_budget(1 << 20) + 1.5
    assert [p.name for p in (tmp_path / "hf").rglob("*") if p.is_file()] == []  # no blob, no temporary


@pytest.mark.parametrize("file", [SHARD, "config.json"])  # LFS sha256, and the git blob id of a plain file
def test_download_checks_the_published_digest(hub: HubServer, repo, tmp_path, checkpoint, file):
    src = open_hub(hub, tmp_path)
    hub.faults.corrupt = {file}
    with pytest.raises(ChecksumMismatchError, match=file):
        src.download(file)
    assert [p.name for p in (tmp_path / "hf").rglob("*") if p.is_file()] == []
    hub.faults.corrupt = set()
    assert Path(src.download(file)).read_bytes() == (checkpoint / file).read_bytes()
