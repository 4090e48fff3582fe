"""The retry policy shared by every remote source.

A source wraps one network operation in :meth:`RetryPolicy.run`. The operation classifies its own
failures: permanent ones are raised as typed ``otfload`` errors (not found, permission) and end the
call at once; transient ones (connection errors, timeouts, 5xx, 429, truncated bodies) are raised as
:class:`TransientError` (or a builtin ``ConnectionError``/``TimeoutError``) and are retried with
exponential backoff and jitter, up to a bounded number of attempts and an overall deadline. Past
the bound the caller gets a :class:`~otfload.errors.SourceUnavailableError` naming the source and
file; the message is built from ``where`` and the last error only, so it never holds credentials.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TypeVar

from otfload.errors import SourceUnavailableError

T = TypeVar("T")

# HTTP statuses worth retrying: request timeout, rate limiting, and server-side failures.
TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class TransientError(Exception):
    """A failure worth retrying (the source has already classified the raw error)."""


def is_transient_status(status: int) -> bool:
    """Whether an HTTP status means "try again later" rather than "this will never work"."""
    return status in TRANSIENT_HTTP_STATUSES


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and equal jitter.

    The defaults ride out a server restart or a burst of 5xx lasting ~10 s and give up within a
    minute; ``attempt_timeout_s`` bounds every single network wait (connect, read, object call).
    """

    attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    deadline_s: float = 60.0
    attempt_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")

    def delay(self, retry: int) -> float:
        """Sleep before retry number ``retry`` (0-based): half fixed, half random, capped."""
        ceiling = min(self.max_delay_s, self.base_delay_s * 2**retry)
        return ceiling / 2 + random.uniform(0, ceiling / 2)

    def run(self, attempt: Callable[[], T], where: str) -> T:
        """Call ``attempt`` until it succeeds, fails permanently, or the bounds are spent.

        ``where`` names the source and file for the final error, e.g. ``"hub:org/name@main: a.safetensors"``.
        """
        start = time.monotonic()
        for retry in range(self.attempts):
            try:
                return attempt()
            except (TransientError, ConnectionError, TimeoutError) as e:
                last = e
            elapsed = time.monotonic() - start
            pause = self.delay(retry)
            if retry + 1 == self.attempts or elapsed + pause > self.deadline_s:
                break
            time.sleep(pause)
        raise SourceUnavailableError(
            f"{where}: unreachable after {retry + 1} attempt(s) in {time.monotonic() - start:.1f}s "
            f"(last error: {type(last).__name__}: {last})"
        ) from last


class RetriedCalls:
    """Mixin for remote sources: :meth:`_call` runs one network operation under ``self._retry``,
    with the source's own ``self._translated(file)`` turning library errors into otfload errors."""

    _retry: RetryPolicy
    description: str

    def _translated(self, file: str | None) -> AbstractContextManager[None]:
        raise NotImplementedError

    def _call(self, fn: Callable[[], T], file: str | None = None) -> T:
        def attempt() -> T:
            with self._translated(file):
                return fn()

        return self._retry.run(attempt, f"{self.description}: {file}" if file else self.description)
