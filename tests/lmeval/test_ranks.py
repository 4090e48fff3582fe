"""lm_eval's multi-process exchanges (:class:`otfload.lm_eval.ranks.Ranks`) between threads that
share one key-value store, as processes share jax.distributed's: every rank's object, by rank;
gathered to one rank only; torch tensors joined as accelerate joins them; values larger than a
key holds; a process that never arrives named in a typed error instead of a hang."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from otfload.coordination import LocalCoordinator
from otfload.errors import CollectiveError, CollectiveTimeoutError, InvalidOptionError
from otfload.lm_eval import ranks
from otfload.lm_eval.ranks import Ranks


class Process:
    """One process's view of a store shared by ``count`` processes."""

    def __init__(self, store: LocalCoordinator, index: int, count: int) -> None:
        self.process_index, self.process_count = index, count
        self.publish, self.wait_for = store.publish, store.wait_for


def run_ranks(count, job, timeout_s=30.0):
    """``job(ranks)`` on ``count`` threads, each one rank of the same store; their results by rank."""
    store = LocalCoordinator()
    start = threading.Barrier(count)

    def one(q):
        r = Ranks(Process(store, q, count), timeout_s=timeout_s, job="t")
        start.wait()
        return job(r)

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


def test_gathers_and_barriers_between_three_processes(monkeypatch):
    import torch

    monkeypatch.setattr(ranks, "CHUNK_CHARS", 100)  # a sample's text spans many keys

    def job(r):
        big = {"rank": r.rank, "text": "x" * 1000 * (r.rank + 1), "arr": np.arange(r.rank + 2)}
        everyone = r.all_gather_object(big)
        r.barrier()
        at_one = r.gather_object((r.rank, [r.rank] * 3), dst=1)
        counts = r.all_gather(torch.tensor(10 + r.rank))
        rows = r.all_gather(torch.tensor([[r.rank, r.rank]]))
        return everyone, at_one, counts, rows

    results = run_ranks(3, job)
    for q, (everyone, at_one, counts, rows) in enumerate(results):
        assert [e["rank"] for e in everyone] == [0, 1, 2]
        assert [len(e["text"]) for e in everyone] == [1000, 2000, 3000]
        assert [e["arr"].tolist() for e in everyone] == [[0, 1], [0, 1, 2], [0, 1, 2, 3]]
        assert at_one == ([(p, [p] * 3) for p in range(3)] if q == 1 else None)
        assert isinstance(counts, torch.Tensor) and counts.tolist() == [10, 11, 12]  # as lm_eval reads it
        assert rows.tolist() == [[0, 0], [1, 1], [2, 2]]


def test_one_process_exchanges_nothing():
    r = Ranks()
    assert (r.rank, r.world_size) == (0, 1)
    assert r.all_gather_object("a") == ["a"] and r.gather_object("a") == ["a"]
    r.barrier()


def test_a_process_that_never_arrives_is_named():
    def job(r):
        if r.rank == 1:
            return None  # never reaches the barrier
        with pytest.raises(CollectiveTimeoutError, match="process 1 did not reach") as info:
            r.barrier()
        return info.value.processes

    assert run_ranks(2, job, timeout_s=0.3)[0] == [1]


def test_a_process_that_left_ends_the_wait_with_its_reason():
    def job(r):
        if r.rank == 1:
            r.leave("ValueError: no documents")  # fails before its first exchange
            return None
        with pytest.raises(CollectiveError, match="process 1 left the job .*ValueError: no documents") as info:
            r.barrier()
        return type(info.value), info.value.processes

    assert run_ranks(2, job, timeout_s=600)[0] == (CollectiveError, [1])  # not the 600 s timeout


def test_joining_a_job_takes_all_three_or_none():
    ranks.join_job(None, None, None)  # one process: nothing to join (jax.distributed untouched)
    flags = ("--coordinator", "--num-processes", "--process-id")
    with pytest.raises(InvalidOptionError, match="--coordinator, --num-processes and --process-id go together"):
        ranks.join_job("127.0.0.1:1", 2, None, flags)
    with pytest.raises(InvalidOptionError, match="process_id 2: expected 0 to 1"):
        ranks.join_job("127.0.0.1:1", 2, 2)
