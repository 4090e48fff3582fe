"""Two loads at once on the process's shared fetch threads keep their own cancel tokens and meters:
one cancelled, the other finishes with exactly its own bytes and requests (a batch of runs, and two
whole loads from two Hub-protocol servers, counted against what the servers sent)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from otfload.accounting.meter import FetchMeter, metering
from otfload.errors import LoadCancelled, SourceNotFoundError
from otfload.index.checkpoint import open_index
from otfload.place.loader import execute_plan
from otfload.place.report import LoadReport
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.mapping import as_table
from otfload.plan.planner import LoadPlan, build_plan
from otfload.sources.fetch_threads import read_runs
from otfload.sources.retry import CancelToken, RetryPolicy, TransientError, cancel_scope, current_token
from otfload.sources.runs import coalesce
from tests.servers.hub_server import HubServer
from tests.sources.test_chunked_reads import SmallChunkHub
from tests.sources.test_fetch_threads import FILES, fetch_from_files
from tests.sources.test_runs import reads_of
from tests.synthetic import write_checkpoint

SETTLE_S = 10.0
A_RUN, B_RUN = 1000, 10  # A's runs and B's differ in size: a byte counted on the wrong meter shows


def test_a_cancelled_load_stops_while_another_finishes_with_its_own_exact_counts():
    token_a, token_b, meter_a, meter_b = CancelToken(), CancelToken(), FetchMeter(), FetchMeter()
    a_retrying, b_fetching, a_cancelled = threading.Barrier(5), threading.Event(), threading.Event()
    a_errors: list[BaseException] = []
    b_tokens: list[tuple[CancelToken | None, bool]] = []  # what B's fetches saw: their token, cancelled?
    # Retried until the load is cancelled: the retry loop itself must see A's token in A's fetch threads.
    policy = RetryPolicy(attempts=100_000, base_delay_s=0.01, max_delay_s=0.02, deadline_s=60.0)

    def never_answers(file: str, offset: int, out: memoryview) -> None:
        first = [True]

        def attempt() -> None:
            if first[0]:
                first[0] = False
                a_retrying.wait(SETTLE_S)
            raise TransientError("503")

        policy.run(attempt, f"test-a: {file}")

    def answers_after_a_is_cancelled(file: str, offset: int, out: memoryview) -> None:
        b_fetching.set()
        assert a_cancelled.wait(SETTLE_S)
        token = current_token()
        b_tokens.append((token, token is not None and token.cancelled))
        fetch_from_files(file, offset, out)

    def load_a() -> None:
        with cancel_scope(token_a), metering(meter_a):
            try:
                read_runs(coalesce(reads_of([("a", i * 2 * A_RUN, A_RUN) for i in range(8)]), gap=0), never_answers, 4)
            except LoadCancelled as e:
                a_errors.append(e)

    reads_b = reads_of([("b", i * 100, B_RUN) for i in range(12)])

    def load_b() -> None:
        with cancel_scope(token_b), metering(meter_b):
            read_runs(coalesce(reads_b, gap=0), answers_after_a_is_cancelled, 4)

    thread_a = threading.Thread(target=load_a)
    thread_a.start()
    a_retrying.wait(SETTLE_S)  # A's 4 runs are in their retry loops on the shared fetch threads
    thread_b = threading.Thread(target=load_b)
    thread_b.start()
    assert b_fetching.wait(SETTLE_S)  # B's runs are fetching on the same threads
    token_a.cancel()
    a_cancelled.set()
    thread_a.join(SETTLE_S)
    thread_b.join(SETTLE_S)
    assert not thread_a.is_alive() and not thread_b.is_alive()

    assert len(a_errors) == 1 and "test-a: a" in str(a_errors[0])  # A stopped, by its own cancel
    assert not token_b.cancelled and len(b_tokens) == 12  # B never saw A's cancel
    assert all(t is not None and t is not token_a and not cancelled for t, cancelled in b_tokens)
    assert [bytes(r.out) for r in reads_b] == [FILES["b"][i * 100 : i * 100 + B_RUN] for i in range(12)]
    assert (meter_b.bytes, meter_b.requests) == (12 * B_RUN, 12)  # exact: none of A's fetches
    assert (meter_a.bytes, meter_a.requests) == (4 * A_RUN, 4)  # the 4 runs A started; none of B's


TENSORS, SHAPE = 6, (256, 256)  # 256 KiB each: 4 runs of SmallChunkHub's 64 KiB, on the fetch threads
FAST = RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=5.0, attempt_timeout_s=5.0)


def planned(server: HubServer, tmp_path: Path, name: str) -> tuple[SmallChunkHub, LoadPlan]:
    rng = np.random.default_rng(len(name))
    tensors = {f"t{i}": rng.standard_normal(SHAPE, dtype=np.float32) for i in range(TENSORS)}
    repo = server.add_repo(
        f"org/two-loads-{tmp_path.name}-{name}", write_checkpoint(tmp_path / name, tensors, files=TENSORS)
    )
    src = SmallChunkHub(repo, endpoint=server.url, cache_dir=tmp_path / f"hf-{name}", retry=FAST)
    index = open_index(src, require_config=False)
    tree = {k: jax.ShapeDtypeStruct(SHAPE, np.float32) for k in sorted(index.tensors)}
    leaves, _ = abstract_from_pytree(tree, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))
    return src, build_plan(index, leaves, as_table({k: k for k in tree}), {})


def test_two_loads_at_once_one_fails_the_other_counts_exactly_what_its_server_sent(hub: HubServer, tmp_path):
    src_a, plan_a = planned(hub, tmp_path, "a")
    with HubServer(tmp_path / "hub-b") as hub_b:
        src_b, plan_b = planned(hub_b, tmp_path, "b")
        (hub.root / src_a.repo_id / plan_a.leaves["t0"].sources[0].file).unlink()  # A: one file gone (404) ...
        hub.faults.stall_next = 10**6  # ... the others stall: only A's cancellation ends their requests
        hub_b.faults.delay_s = 0.2  # B is still loading when A fails: 24 requests, 2 at a time
        before, asked = hub_b.body_bytes, len(hub_b.requests("GET", "/resolve/"))  # the plan's header reads
        reports: list[LoadReport] = []
        thread_b = threading.Thread(target=lambda: reports.append(execute_plan(plan_b, src_b, workers=2)[1]))
        thread_b.start()
        deadline = time.monotonic() + SETTLE_S
        while len(hub_b.requests("GET", "/resolve/")) == asked and time.monotonic() < deadline:
            time.sleep(0.005)
        start = time.monotonic()
        with pytest.raises(SourceNotFoundError):
            execute_plan(plan_a, src_a, workers=2)
        took = time.monotonic() - start
        assert took < 5.0, f"{took:.2f}s"  # A's stalled requests were cut, not waited out (10 s each)
        assert thread_b.is_alive()  # B was loading all along
        thread_b.join(4 * SETTLE_S)
        assert len(reports) == 1, "B failed or hung"
        (report,) = reports
        gets = hub_b.requests("GET", "/resolve/")[asked:]
        assert report.bytes_read == report.bytes_planned == hub_b.body_bytes - before
        assert report.requests == len(gets) > TENSORS  # each range in several runs, none of A's counted
