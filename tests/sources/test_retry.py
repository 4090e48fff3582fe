"""The shared retry policy: bounded attempts, backoff with jitter, overall deadline, permanent errors pass."""

from __future__ import annotations

import time

import pytest

from otfload.errors import SourceNotFoundError, SourceUnavailableError
from otfload.sources.retry import RetryPolicy, TransientError, is_transient_status

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
