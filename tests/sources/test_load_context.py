"""Two loads at once on the process's shared fetch threads keep their own cancel tokens and meters."""

from __future__ import annotations

import threading

from otfload.errors import LoadCancelled
from otfload.fetch.meter import FetchMeter, metering
from otfload.sources.fetch_threads import read_runs
from otfload.sources.retry import CancelToken, RetryPolicy, TransientError, cancel_scope, current_token
from otfload.sources.runs import coalesce
from tests.sources.test_fetch_threads import FILES, fetch_from_files
from tests.sources.test_runs import reads_of

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
