"""The shared retry policy: bounded attempts, backoff with jitter, overall deadline, permanent errors pass;
long retries announced once."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from otfload.errors import InvalidOptionError, SourceNotFoundError, SourceUnavailableError
from otfload.sources.retry import (
    RetryNotice,
    RetryPolicy,
    SourceRetryingWarning,
    TransientError,
    is_transient_status,
)

QUICK = RetryPolicy(attempts=4, base_delay_s=0.001, max_delay_s=0.002, deadline_s=5.0)


def flaky(failures: list[BaseException], result: str = "ok"):
    """A callable raising ``failures`` in turn, then returning ``result``; ``calls`` counts calls."""

    def fn() -> str:
        fn.calls += 1
        if failures:
            raise failures.pop(0)
        return result

    fn.calls = 0
    return fn


def test_transient_failures_then_success():
    fn = flaky([TransientError("HTTP 503"), ConnectionResetError(), TimeoutError()])
    assert QUICK.run(fn, "src: f") == "ok"
    assert fn.calls == 4


def test_gives_up_after_attempts_naming_where_and_last_error():
    fn = flaky([TransientError(f"HTTP 503 #{i}") for i in range(10)])
    with pytest.raises(SourceUnavailableError, match=r"hub:org/m@main: a\.safetensors.*4 attempt.*HTTP 503 #3") as e:
        QUICK.run(fn, "hub:org/m@main: a.safetensors")
    assert fn.calls == 4
    assert isinstance(e.value.__cause__, TransientError)


def test_deadline_bounds_total_time():
    policy = RetryPolicy(attempts=1000, base_delay_s=0.05, max_delay_s=0.05, deadline_s=0.3)
    start = time.monotonic()
    with pytest.raises(SourceUnavailableError):
        policy.run(flaky([ConnectionRefusedError()] * 1000), "src")
    assert time.monotonic() - start < 0.5


@pytest.mark.parametrize("error", [SourceNotFoundError("gone"), ValueError("bug")])
def test_permanent_errors_are_not_retried(error):
    fn = flaky([error])
    with pytest.raises(type(error)):
        QUICK.run(fn, "src")
    assert fn.calls == 1


def test_backoff_grows_with_jitter_and_is_capped():
    policy = RetryPolicy(base_delay_s=0.1, max_delay_s=1.0)
    for retry, ceiling in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        delays = [policy.delay(retry) for _ in range(50)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 1


@pytest.mark.parametrize(("status", "transient"), [(503, True), (429, True), (500, True), (404, False), (401, False)])
def test_transient_statuses(status, transient):
    assert is_transient_status(status) is transient


def failing_for(seconds: float):
    """A callable refusing connections for ``seconds`` after its first call, then returning "ok"."""
    first: list[float] = []

    def fn() -> str:
        first.append(time.monotonic())
        if first[-1] - first[0] < seconds:
            raise ConnectionRefusedError("refused")
        return "ok"

    return fn


def test_a_request_failing_past_the_threshold_is_announced_once():
    policy = RetryPolicy(attempts=100, base_delay_s=0.01, max_delay_s=0.02, deadline_s=5.0, notice_after_s=0.1)
    start = time.monotonic()
    with pytest.warns(SourceRetryingWarning) as shown:
        assert (
            policy.run(failing_for(0.3), "src: f", url="http://hub.example:8080/a", notice=RetryNotice("a hint"))
            == "ok"
        )
    assert len(shown) == 1, [str(w.message) for w in shown]
    text = str(shown[0].message)
    assert text.startswith("hub.example:8080: unreachable for ") and text.endswith(" s (a hint)")
    assert "(ConnectionRefusedError: refused), retrying up to" in text
    assert float(text.removeprefix("hub.example:8080: unreachable for ").split(" s ")[0]) >= 0.1
    assert time.monotonic() - start >= 0.3


def test_the_notice_counts_the_attempts_left_and_names_where_without_a_url():
    with pytest.warns(
        SourceRetryingWarning,
        match=r"^src: f: unreachable for \d\.\d s \(HTTP 503\), "
        r"retrying up to 4 more time\(s\) for about 0\.0 s$",
    ):
        RetryPolicy(attempts=5, base_delay_s=0.001, max_delay_s=0.001, notice_after_s=0).run(
            flaky([TransientError("HTTP 503")]), "src: f", notice=RetryNotice()
        )


def test_no_notice_before_the_threshold_or_when_no_retry_follows():
    with warnings.catch_warnings():
        warnings.simplefilter("error", SourceRetryingWarning)
        assert QUICK.run(flaky([TransientError("HTTP 503")] * 3), "src", notice=RetryNotice()) == "ok"
        # the second failure comes after the threshold, but it is the last attempt: the error says the rest
        policy = RetryPolicy(attempts=2, base_delay_s=0.2, max_delay_s=0.2, notice_after_s=0.05)
        with pytest.raises(SourceUnavailableError):
            policy.run(flaky([ConnectionRefusedError()] * 2), "src", notice=RetryNotice())


def test_one_notice_for_all_the_requests_of_a_source():
    policy = RetryPolicy(attempts=100, base_delay_s=0.01, max_delay_s=0.02, notice_after_s=0.05)
    notice = RetryNotice()
    with pytest.warns(SourceRetryingWarning) as shown:
        threads = [threading.Thread(target=policy.run, args=(failing_for(0.2), f"src: f{i}"), kwargs={"notice": notice})
                   for i in range(8)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(shown) == 1


def test_the_notice_threshold_is_checked():
    with pytest.raises(InvalidOptionError, match="notice_after_s must be >= 0"):
        RetryPolicy(notice_after_s=-1)
