"""The first permanent failure cancels the rest of a load: it fails in about one leaf's failure time,
not one per leaf, and the leaves after it never reach the server (real Hub-protocol server, no mocks).

- every file GET answers 503: a load of 12 leaves on 2 builders fails once the first leaf's retries
  are spent (without cancellation: 6 rounds of them), with about 2 leaves' worth of requests;
- one file is gone (404, permanent at once) while the others stall: the stalled request in flight
  is cut at once, not after its attempt budget;
- ``timeout=`` of ``load_params`` is the load's total deadline;
- the parallel range reader of one batch stops its sibling runs (and their retries) the same way.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import jax
import numpy as np
import pytest

import otfload
from otfload.errors import SourceNotFoundError, SourceTimeoutError, SourceUnavailableError
from otfload.index.checkpoint import open_index
from otfload.place.loader import execute_plan
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.mapping import as_table
from otfload.plan.planner import LoadPlan, build_plan
from otfload.sources.base import RangeRead, read_bytes
from otfload.sources.fetch_threads import read_runs
from otfload.sources.hub import HubSource
from otfload.sources.retry import RetryPolicy, TransientError
from otfload.sources.runs import coalesce
from tests.servers.hub_server import HubServer
from tests.synthetic import write_checkpoint

LEAVES = 12
WORKERS = 2  # without cancellation the load would take LEAVES / WORKERS rounds of failures
SHAPE = (64, 64)
ALWAYS = 10**6  # a fault counter that never runs out within a test
# Each leaf's retries take ~0.5 s (4 attempts, backoff 0.1 + 0.2 + 0.2 s): long enough to measure,
# short enough for the suite.
POLICY = RetryPolicy(attempts=4, base_delay_s=0.1, max_delay_s=0.2, deadline_s=5.0, attempt_timeout_s=2.0)


@pytest.fixture
def repo(hub: HubServer, tmp_path: Path) -> str:
    rng = np.random.default_rng(0)
    tensors = {f"t{i:02d}": rng.standard_normal(SHAPE, dtype=np.float32) for i in range(LEAVES)}
    repo_id = f"org/cancel-{tmp_path.name}"
    hub.add_repo(repo_id, write_checkpoint(tmp_path / "ckpt", tensors, files=LEAVES))
    return repo_id


def open_and_plan(hub: HubServer, repo: str, tmp_path: Path, mesh, **kw) -> tuple[HubSource, LoadPlan]:
    """Open the repo and plan a load of every tensor (headers read now, while the server is healthy)."""
    src = HubSource(repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=kw.pop("retry", POLICY), **kw)
    index = open_index(src, require_config=False)
    tree = {k: jax.ShapeDtypeStruct(SHAPE, np.float32) for k in sorted(index.tensors)}
    leaves, _ = abstract_from_pytree(tree, mesh)
    return src, build_plan(index, leaves, as_table({k: k for k in tree}), {})


def test_permanent_failure_cancels_the_other_leaves(hub: HubServer, repo, tmp_path, mesh_2x4):
    src, plan = open_and_plan(hub, repo, tmp_path, mesh_2x4)
    one_file = plan.leaves["t00"].sources[0].file
    hub.faults.fail_next = ALWAYS
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError):
        read_bytes(src, one_file, 0, 100)
    one_leaf_s = time.monotonic() - start

    hub.log.clear()
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError, match="503"):
        execute_plan(plan, src, workers=WORKERS)
    load_s = time.monotonic() - start
    gets = hub.requests("GET", "/resolve/")
    assert load_s < 3 * one_leaf_s, f"load {load_s:.2f}s vs one leaf {one_leaf_s:.2f}s"
    # the two running leaves spent their attempts (one may have been cut short); no other leaf started
    assert len(gets) <= WORKERS * POLICY.attempts < LEAVES * POLICY.attempts
    assert len({r.path for r in gets}) <= WORKERS


def test_failure_cuts_requests_in_flight(hub: HubServer, repo, tmp_path, mesh_2x4):
    src, plan = open_and_plan(hub, repo, tmp_path, mesh_2x4)
    first = plan.leaves[next(iter(plan.leaves))].sources[0].file
    (hub.root / repo / first).unlink()  # 404 from now on: permanent, raised at once
    hub.faults.stall_next = ALWAYS  # every other file: half a body, then silence
    hub.log.clear()
    start = time.monotonic()
    with pytest.raises(SourceNotFoundError, match=first):
        execute_plan(plan, src, workers=WORKERS)
    took = time.monotonic() - start
    # the stalled leaf alone would wait its attempt budget (2 s) per attempt, 4 times
    assert took < 1.0, f"{took:.2f}s"
    assert len(hub.requests("GET", "/resolve/")) <= WORKERS + 1


def test_load_params_timeout_is_the_total_deadline(hub: HubServer, repo, tmp_path, mesh_2x4):
    patient = RetryPolicy(attempts=50, base_delay_s=0.01, max_delay_s=0.05, deadline_s=60, attempt_timeout_s=30)
    shutil.rmtree(tmp_path / "hf", ignore_errors=True)
    hub.faults.stall_next = ALWAYS
    tree = {f"t{i:02d}": jax.ShapeDtypeStruct(SHAPE, np.float32) for i in range(LEAVES)}
    start = time.monotonic()
    with pytest.raises(SourceTimeoutError, match="timeout of 1.5s") as e:
        otfload.load_params(
            repo, tree, {k: k for k in tree}, mesh=mesh_2x4, endpoint=hub.url, cache_dir=tmp_path / "hf",
            retry=patient, timeout=1.5,
        )  # fmt: skip
    assert time.monotonic() - start < 3.0
    assert e.value.url.startswith(f"{hub.url}/{repo}/resolve/")


def test_read_runs_cancels_sibling_runs_and_their_retries():
    """The parallel range reader of one request batch: a permanent failure ends the batch at once."""
    patient = RetryPolicy(attempts=50, base_delay_s=0.2, max_delay_s=0.2, deadline_s=60)
    calls: list[int] = []

    def fetch_into(file: str, offset: int, out: memoryview) -> None:
        calls.append(offset)
        if offset == 0:
            time.sleep(0.1)  # the others are in their retries by now
            raise SourceNotFoundError(f"{file} is gone")

        def attempt() -> None:
            raise TransientError("HTTP 503")

        patient.run(attempt, f"src: {file}@{offset}")  # ~10 s of retries unless cancelled

    runs = coalesce([RangeRead("f", i * 10 << 20, memoryview(bytearray(8))) for i in range(12)])
    start = time.monotonic()
    with pytest.raises(SourceNotFoundError, match="gone"):
        read_runs(runs, fetch_into, max_workers=4)
    assert time.monotonic() - start < 1.0
    assert len(calls) == 4  # the 8 runs queued behind the 4 running ones never started
