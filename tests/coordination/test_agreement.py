"""The agreement of a multi-process load (otfload/coordination/agreement.py), with the processes simulated by
threads sharing one key-value store: every process ends with the same facts, or with the same typed
error within the bound — a mismatch, a failure elsewhere, a process that never arrives, a collective
that never completes. The real 4-process loads are in tests/multihost/test_fetch.py."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from otfload.coordination import LocalCoordinator
from otfload.coordination.agreement import Agreement, Facts, run_bounded
from otfload.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError
from otfload.place.agree import is_cold
from otfload.place.collective_route import cold_processes

PROCESSES = 4
BOUND_S = 1.0  # the simulated processes' bound: short, the waits are on purpose
SLACK_S = 2.0  # thread start-up and the store's wakeups on a loaded 2-core machine


class ProcessView:
    """One simulated process's view of the shared store (its own index)."""

    def __init__(self, store: LocalCoordinator, index: int):
        self.store, self.process_index, self.process_count = store, index, PROCESSES

    def publish(self, key: str, value: str) -> None:
        self.store.publish(key, value)

    def wait_for(self, key: str, timeout_s: float) -> str | None:
        return self.store.wait_for(key, timeout_s)


def facts(resident: float | None = 1.0, plan: str = "p1", policy: str = "auto") -> Facts:
    return Facts(plan=plan, policy=policy, source="local", resident=resident)


def run_processes(body: Callable[[int, Agreement], object], rounds: list[dict[str, int]] | None = None,
                  store: LocalCoordinator | None = None, who: range = range(PROCESSES)) -> dict[int, object]:
    """``body(q, agreement)`` on each simulated process ``q`` in ``who``, in threads; result or error by process."""
    store = store or LocalCoordinator()
    rounds = rounds or [{} for _ in range(PROCESSES)]
    out: dict[int, object] = {}

    def one(q: int) -> None:
        try:
            out[q] = body(q, Agreement(ProcessView(store, q), "mesh", BOUND_S, rounds[q]))
        except Exception as e:
            out[q] = e

    threads = [threading.Thread(target=one, args=(q,)) for q in who]
    for t in threads:
        t.start()
    for t in threads:
        t.join(BOUND_S * 3 + SLACK_S * 3)
    return out


def test_every_process_gets_the_same_facts_and_one_cold_host_makes_the_load_cold():
    # Process 2 finds 10 % of its files in the page cache, process 1 97 % (warm: a few pages evicted).
    resident = {0: 1.0, 1: 0.97, 2: 0.1, 3: 1.0}
    out = run_processes(lambda q, a: a.facts(facts(resident[q])))
    assert len(out) == PROCESSES and len(set(out.values())) == 1, out
    agreed = out[0]
    assert agreed.resident == (1.0, 0.97, 0.1, 1.0) and agreed.processes == PROCESSES  # type: ignore[attr-defined]
    assert is_cold(agreed) and cold_processes(agreed.resident) == [2]  # type: ignore[arg-type,attr-defined]
    warm = run_processes(lambda q, a: a.facts(facts(0.95 if q == 3 else 1.0)))
    assert not any(is_cold(o) for o in warm.values())  # type: ignore[arg-type]


def test_another_plan_or_policy_on_one_process_ends_the_load_on_every_process():
    for field, mine in (("plan", facts(plan="other")), ("policy", facts(policy="never"))):
        out = run_processes(lambda q, a, mine=mine: a.facts(mine if q == 3 else facts()))
        assert all(isinstance(e, CollectiveMismatchError) for e in out.values()), out
        assert all(f"disagree on its {field}" in str(e) for e in out.values())
        assert out[0].processes == [3]  # type: ignore[attr-defined]


def test_different_reshard_lists_name_the_first_leaf_that_differs():
    mine = ["a.kernel", "b.kernel", "c.kernel"]
    theirs = ["a.kernel", "c.kernel"]  # process 1 dropped b's band
    out = run_processes(lambda q, a: a.before_collectives(theirs if q == 1 else mine))
    assert all(isinstance(e, CollectiveMismatchError) for e in out.values()), out
    assert {e.leaf for e in out.values()} == {"b.kernel"}  # type: ignore[attr-defined]


def test_a_failure_on_one_process_ends_the_others_at_once():
    def body(q: int, a: Agreement) -> object:
        if q == 1:
            a.abort(OSError("disk gone"))
            return "aborted"
        return a.before_collectives(["a.kernel"])

    start = time.monotonic()
    out = run_processes(body)
    assert time.monotonic() - start < BOUND_S  # nobody waited for the bound
    errors = [out[q] for q in (0, 2, 3)]
    assert all(type(e) is CollectiveError and "process 1 failed" in str(e) and "disk gone" in str(e) for e in errors)


def test_a_missing_process_times_out_everywhere_and_the_retry_meets_in_a_fresh_round():
    store, rounds = LocalCoordinator(), [{} for _ in range(PROCESSES)]
    start = time.monotonic()
    out = run_processes(lambda q, a: a.facts(facts()), rounds, store, who=range(3))  # process 3 never comes
    assert time.monotonic() - start < BOUND_S + SLACK_S
    assert all(isinstance(e, CollectiveTimeoutError) and e.processes == [3] for e in out.values()), out
    # The retry: processes 0-2 are one round on, process 3 (which never joined) is not; all meet.
    again = run_processes(lambda q, a: (a.round, a.facts(facts())), rounds, store)
    assert {r for r, _ in again.values()} == {1}, again  # type: ignore[misc]


def test_a_collective_that_never_completes_ends_the_load_naming_its_leaf():
    never = threading.Event()
    steps = [("a.kernel", lambda: 1), ("b.kernel", lambda: never.wait())]
    start = time.monotonic()
    with pytest.raises(CollectiveTimeoutError, match="leaf 'b.kernel'") as e:
        run_bounded(steps, BOUND_S)
    assert e.value.leaf == "b.kernel" and time.monotonic() - start < BOUND_S + SLACK_S
    never.set()
    assert run_bounded([("a", lambda: 1), ("b", lambda: 2)], BOUND_S) == [1, 2]
    with pytest.raises(ZeroDivisionError):  # a collective's own error is raised as it is
        run_bounded([("a", lambda: 1 // 0)], BOUND_S)
