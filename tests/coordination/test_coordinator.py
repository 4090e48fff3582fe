"""LocalCoordinator, the store of a one-process job: what a waiter sees, from another thread, and
what it sees after its deadline; current_coordinator outside jax.distributed."""

from __future__ import annotations

import threading
import time

from otfload.coordination import LocalCoordinator, current_coordinator


def test_a_waiter_sees_what_another_thread_publishes():
    store = LocalCoordinator()
    threading.Timer(0.05, store.publish, ("k", "ok")).start()
    assert store.wait_for("k", 5.0) == "ok"
    store.publish("k", "again")  # a key may be set again: the latest value is read
    assert store.wait_for("k", 0.0) == "again"


def test_a_key_nobody_publishes_is_none_after_the_deadline():
    store = LocalCoordinator(1, 2)
    start = time.monotonic()
    assert store.wait_for("missing", 0.1) is None
    assert 0.1 <= time.monotonic() - start < 2.0
    assert (store.process_index, store.process_count) == (1, 2)


def test_one_process_without_jax_distributed_gets_a_local_store():
    coordinator = current_coordinator()
    assert isinstance(coordinator, LocalCoordinator)
    assert (coordinator.process_index, coordinator.process_count) == (0, 1)
