"""The retry policy, time bounds and cancellation shared by every remote source.

A source wraps one network operation in :meth:`RetryPolicy.run`. The operation classifies its own
failures: permanent ones are raised as typed ``otfload`` errors (not found, permission, protocol)
and end the call at once; transient ones (connection errors, timeouts, 5xx, 429, truncated bodies)
are raised as :class:`TransientError` (or a builtin ``ConnectionError``/``TimeoutError``) and are
retried with exponential backoff and jitter, up to a bounded number of attempts and an overall
deadline. Past the bound the caller gets a :class:`~otfload.errors.SourceUnavailableError` naming
the source and file (:class:`~otfload.errors.SourceTimeoutError` when the last attempt timed out);
the message is built from ``where``, the URL and the last error only, so it never holds credentials.

Three clocks bound every network read:

- **idle** (``RetryPolicy.read_timeout_s``): the longest wait for a connection or for the next bytes;
- **attempt** (:meth:`RetryPolicy.attempt_budget`): one request, from connect to its last byte,
  ``attempt_timeout_s`` plus the bytes asked for at ``min_rate_bytes_s`` -- a server that drips
  bytes just fast enough to beat the idle clock still fails its attempt;
- **total** (:class:`Deadline`, the ``timeout=`` of a load or ``OTFLOAD_TIMEOUT``): no request starts
  or continues past it, and the error names the URL and the bytes received.

A load also carries a :class:`CancelToken` (set in its context with :func:`cancel_scope`, seen by the
threads working for it through :func:`~otfload.sources.load_context.submit`): once one part of a load
fails for good, the rest stop between attempts, in their backoff sleep, or mid-request.
:class:`RequestSlots` bounds the requests a source has in flight across all its threads; waiting for a
slot ends as soon as the load is cancelled.

A request still failing :attr:`RetryPolicy.notice_after_s` seconds after its first attempt, and about
to be tried again, is said aloud once per source (so once per load, whatever the requests and
threads failing): a :class:`SourceRetryingWarning` from the source's :class:`RetryNotice`, naming the
host, the last error and how long the retries may go on, so that a load waiting out an unreachable
server is not silent (the command line prints it as ``otfload: warning: ...``).
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import math
import random
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

from otfload.errors import InvalidOptionError, LoadCancelled, SourceTimeoutError, SourceUnavailableError

T = TypeVar("T")

# HTTP statuses worth retrying: request timeout, rate limiting, and server-side failures.
TRANSIENT_HTTP_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
# The environment variable giving the total deadline of a load when ``timeout=`` is not passed.
TIMEOUT_ENV = "OTFLOAD_TIMEOUT"
# How long a request may go on failing before its retries are announced: issue 44's "progress on
# every step over ~2 s". Below it a blip (a restart, a short 5xx burst) ridden out within the
# default backoff's first three retries (0.7-1.4 s of sleep) says nothing; past it the user learns
# why the load is waiting (e.g. ~12 s of refused connections offline) and how to stop waiting.
NOTICE_AFTER_S = 2.0


class TransientError(Exception):
    """A failure worth retrying (the source has already classified the raw error)."""


class StallError(TransientError):
    """An attempt that ran out of time: no bytes within the idle timeout, or past its deadline.

    ``received`` counts the bytes of the requested range that had arrived.
    """

    def __init__(self, message: str, received: int = 0):
        self.received = received
        super().__init__(message)


class SourceRetryingWarning(UserWarning):
    """A source's requests have been failing for a while and are being retried: the load waits, it
    has not hung."""


class RetryNotice:
    """Says once, for every request of one source (one load), that its requests are being retried.

    ``hint`` (e.g. how to work offline) ends the message.
    """

    def __init__(self, hint: str = ""):
        self.hint = hint
        self._lock = threading.Lock()
        self._said = False

    @property
    def pending(self) -> bool:
        """Whether the notice is still to be given."""
        return not self._said

    def say(self, message: str) -> None:
        """Warn with ``message`` unless this notice has been given already."""
        with self._lock:
            if self._said:
                return
            self._said = True
        hint = f" ({self.hint})" if self.hint else ""
        warnings.warn(f"{message}{hint}", SourceRetryingWarning, stacklevel=2)


def is_transient_status(status: int) -> bool:
    """Whether an HTTP status means "try again later" rather than "this will never work"."""
    return status in TRANSIENT_HTTP_STATUSES


# --- the total deadline --------------------------------------------------------------------------


class Deadline:
    """The absolute end of a load (``timeout_s`` seconds after it was made); ``None`` never ends."""

    def __init__(self, timeout_s: float | None):
        ok = isinstance(timeout_s, int | float) and not isinstance(timeout_s, bool) and 0 < timeout_s < math.inf
        if timeout_s is not None and not ok:
            raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout_s!r}")
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.at = math.inf if timeout_s is None else time.monotonic() + timeout_s

    def remaining(self) -> float:
        return self.at - time.monotonic()

    def expired(self) -> bool:
        return self.remaining() <= 0

    def __repr__(self) -> str:
        return f"Deadline(timeout_s={self.timeout_s})"


NO_DEADLINE = Deadline(None)


# --- cancellation --------------------------------------------------------------------------------


class CancelToken:
    """A cancel flag for one load, or one part of it: cancelling a token cancels its children.

    ``on_cancel`` callbacks (e.g. closing a socket a thread is blocked on) run once, at cancel time.
    """

    def __init__(self, parent: CancelToken | None = None):
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()
        self._children: weakref.WeakSet[CancelToken] = weakref.WeakSet()
        if parent is not None:
            with parent._lock:
                parent._children.add(self)
            if parent.cancelled:
                self.cancel()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
            children = list(self._children)
        for fn in callbacks:
            fn()
        for child in children:
            child.cancel()

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True if cancelled meanwhile (returns at once then)."""
        return self._event.wait(max(0.0, seconds))

    def on_cancel(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Run ``fn`` when cancelled (now, if already; what it returns is ignored); returns a
        function unregistering it."""
        with self._lock:
            if not self._event.is_set():
                key = next(self._ids)
                self._callbacks[key] = fn

                def unregister() -> None:
                    self._callbacks.pop(key, None)

                return unregister
        fn()
        return lambda: None


# The cancel token of the load the running code works for: one value per context, carried into the
# load's pool threads by otfload.sources.load_context.submit.
_TOKEN: contextvars.ContextVar[CancelToken | None] = contextvars.ContextVar("otfload_cancel_token", default=None)


def current_token() -> CancelToken | None:
    """The cancel token of the load this code works for, if any."""
    return _TOKEN.get()


@contextmanager
def cancel_scope(token: CancelToken | None) -> Iterator[CancelToken | None]:
    """Make ``token`` the :func:`current_token` of this context for the duration of the block."""
    previous = _TOKEN.set(token)
    try:
        yield token
    finally:
        _TOKEN.reset(previous)


class RequestSlots:
    """At most ``limit`` requests of one source in flight at once, whatever the threads asking.

    :meth:`hold` is taken per attempt (never across a backoff sleep, never nested), so a slot is
    always given back within one attempt's time bound; waiting for one ends with
    :class:`LoadCancelled` once the thread's load is cancelled.
    """

    # How often a waiting thread looks at its cancel token: a cancelled load stops waiting this fast.
    POLL_S = 0.05

    def __init__(self, limit: int):
        if limit < 1:
            raise ValueError(f"RequestSlots limit must be >= 1, got {limit}")
        self.limit = limit
        self._free = threading.Semaphore(limit)

    @contextmanager
    def hold(self, where: str) -> Iterator[None]:
        token = current_token()
        while not self._free.acquire(timeout=self.POLL_S):
            if token is not None and token.cancelled:
                raise LoadCancelled(f"{where}: cancelled while waiting for a request slot")
        try:
            if token is not None and token.cancelled:
                raise LoadCancelled(f"{where}: cancelled, another read of this load failed")
            yield
        finally:
            self._free.release()


# --- alarms --------------------------------------------------------------------------------------


class _Alarms:
    """One daemon thread running callbacks at given monotonic times (cheaper than a Timer each)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._live: set[int] = set()
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None

    def arm(self, when: float, fn: Callable[[], None]) -> Callable[[], None]:
        """Call ``fn`` at monotonic time ``when`` unless the returned disarm function runs first."""
        if math.isinf(when):
            return lambda: None
        with self._cond:
            key = next(self._ids)
            heapq.heappush(self._heap, (when, key, fn))
            self._live.add(key)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="otfload-alarms", daemon=True)
                self._thread.start()
            self._cond.notify()

        def disarm() -> None:
            with self._cond:
                self._live.discard(key)

        return disarm

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, key, fn = heapq.heappop(self._heap)
                due = key in self._live
                self._live.discard(key)
            if due:
                with suppress(Exception):  # an alarm must never kill the thread serving the others
                    fn()


ALARMS = _Alarms()


@contextmanager
def interrupt_at(until: float, fn: Callable[[], None]) -> Iterator[Callable[[], bool]]:
    """Run ``fn`` (which must unblock the current I/O) at ``until`` or when the load is cancelled.

    Yields a function telling whether it fired; the alarm is disarmed when the block ends.
    """
    fired = threading.Event()
    lock = threading.Lock()
    over = False  # the block has ended: ``fn`` must not touch what it guarded (a pooled socket)

    def fire() -> None:
        with lock:
            if not over:
                fired.set()
                fn()

    disarm = ALARMS.arm(until, fire)
    token = current_token()
    unregister = token.on_cancel(fire) if token is not None else (lambda: None)
    try:
        yield fired.is_set
    finally:
        with lock:
            over = True
        disarm()
        unregister()


# --- the policy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded retries with exponential backoff and equal jitter, and the per-read time bounds.

    The defaults ride out a server restart or a burst of 5xx lasting ~10 s and stop retrying after
    a minute. ``read_timeout_s`` is the idle bound (connect, headers, next body bytes);
    one attempt may take :meth:`attempt_budget` seconds in all. ``deadline_s`` stops new attempts;
    the attempt running then still ends within its own budget.
    """

    attempts: int = 8
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    deadline_s: float = 60.0
    # One attempt's fixed allowance: connection, TLS, headers and the latency of a busy server.
    attempt_timeout_s: float = 30.0
    # As huggingface_hub's download timeout (HF_HUB_DOWNLOAD_TIMEOUT): a healthy server never pauses
    # 10 s mid-body; a stalled one is given up on (and resumed by the next attempt) after that.
    read_timeout_s: float = 10.0
    # Slowest transfer an attempt tolerates on top of attempt_timeout_s: 1 MiB/s lets a full 64 MiB
    # run take 94 s; a server dripping bytes slower than that fails its attempt (and is resumed).
    min_rate_bytes_s: float = float(1 << 20)
    # A request failing this long, and about to be retried, is announced through the source's
    # RetryNotice (see NOTICE_AFTER_S); 0 announces the first retry.
    notice_after_s: float = NOTICE_AFTER_S

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise InvalidOptionError(f"RetryPolicy.attempts must be >= 1, got {self.attempts}")
        for name in ("attempt_timeout_s", "read_timeout_s", "min_rate_bytes_s"):
            if not getattr(self, name) > 0:
                raise InvalidOptionError(f"RetryPolicy.{name} must be > 0, got {getattr(self, name)}")
        if not self.notice_after_s >= 0:
            raise InvalidOptionError(f"RetryPolicy.notice_after_s must be >= 0, got {self.notice_after_s}")

    def delay(self, retry: int) -> float:
        """Sleep before retry number ``retry`` (0-based): half fixed, half random, capped."""
        ceiling = self.ceiling(retry)
        return float(ceiling / 2 + random.uniform(0, ceiling / 2))

    def ceiling(self, retry: int) -> float:
        """The longest sleep before retry number ``retry``: doubling from ``base_delay_s`` up to ``max_delay_s``."""
        return min(self.max_delay_s, self.base_delay_s * 2.0 ** min(retry, 1023))  # 2.0**1024 overflows

    def attempt_budget(self, nbytes: int) -> float:
        """Seconds one attempt fetching ``nbytes`` may take, from connecting to its last byte."""
        return self.attempt_timeout_s + nbytes / self.min_rate_bytes_s

    def attempt_until(self, nbytes: int, deadline: Deadline = NO_DEADLINE) -> float:
        """The monotonic time an attempt starting now must end by (its budget, or the load's end)."""
        return min(time.monotonic() + self.attempt_budget(nbytes), deadline.at)

    def run(
        self,
        attempt: Callable[[], T],
        where: str,
        *,
        deadline: Deadline = NO_DEADLINE,
        url: str = "",
        progress: Callable[[], int] | None = None,
        notice: RetryNotice | None = None,
    ) -> T:
        """Call ``attempt`` until it succeeds, fails permanently, or the bounds are spent.

        ``where`` names the source and file for the final error, e.g. ``"hub:org/name@main: a.safetensors"``;
        ``url`` and ``progress`` (bytes received so far) go into a :class:`SourceTimeoutError`.
        Once the call has been failing for ``notice_after_s`` and will try again, ``notice`` says so
        (naming ``url``'s host). Cancelling the thread's :func:`current_token` ends the call with
        :class:`LoadCancelled`.
        """
        token = current_token()
        start = time.monotonic()
        last: BaseException | None = None
        retry = 0
        for retry in range(self.attempts):  # noqa: B007 - the count is reported
            if token is not None and token.cancelled:
                raise LoadCancelled(f"{where}: cancelled, another read of this load failed") from last
            if deadline.expired():
                raise self._timed_out(where, deadline, url, progress, last) from last
            began = time.monotonic()
            try:
                return attempt()
            except (TransientError, ConnectionError, TimeoutError) as e:
                last = e
            if token is not None and token.cancelled:
                raise LoadCancelled(f"{where}: cancelled, another read of this load failed") from last
            if deadline.expired():
                raise self._timed_out(where, deadline, url, progress, last) from last
            elapsed = time.monotonic() - start
            pause = min(self.delay(retry), max(0.0, deadline.remaining()))
            if retry + 1 == self.attempts or elapsed + pause > self.deadline_s:
                break
            if notice is not None and notice.pending and elapsed >= self.notice_after_s:
                window = self._window_s(retry, elapsed, pause, elapsed - (began - start), deadline)
                failed = str(last) if isinstance(last, TransientError) else f"{type(last).__name__}: {last}"
                notice.say(
                    f"{_server(url) or where}: unreachable for {elapsed:.1f} s ({failed}), "
                    f"retrying up to {self.attempts - retry - 1} more time(s) for about {window:.1f} s"
                )
            if token is not None:
                token.wait(pause)
            else:
                time.sleep(pause)
        message = (
            f"{where}: unreachable after {retry + 1} attempt(s) in {time.monotonic() - start:.1f}s "
            f"(last error: {type(last).__name__}: {last})"
        )
        if isinstance(last, StallError | TimeoutError):
            received = progress() if progress is not None else getattr(last, "received", 0)
            raise SourceTimeoutError(f"{message}; {received} byte(s) received from {url or where}",
                                     url=url or where, received=received) from last  # fmt: skip
        raise SourceUnavailableError(message) from last

    def _window_s(self, retry: int, elapsed: float, pause: float, attempt_s: float, deadline: Deadline) -> float:
        """About how long the retries after failed attempt ``retry`` may go on: the sleeps left at their
        longest (``pause`` the next one) and attempts as long as the last one (``attempt_s``), within
        the policy's ``deadline_s`` and the load's ``deadline``."""
        sleeps = pause + sum(self.ceiling(r) for r in range(retry + 1, self.attempts - 1))
        tries = (self.attempts - retry - 1) * attempt_s
        return max(0.0, min(sleeps + tries, self.deadline_s - elapsed, deadline.remaining()))

    @staticmethod
    def _timed_out(
        where: str, deadline: Deadline, url: str, progress: Callable[[], int] | None, last: BaseException | None
    ) -> SourceTimeoutError:
        received = progress() if progress is not None else getattr(last, "received", 0)
        why = f" (last error: {type(last).__name__}: {last})" if last is not None else ""
        return SourceTimeoutError(
            f"{where}: the load's timeout of {deadline.timeout_s:g}s passed with {received} byte(s) received "
            f"from {url or where}{why}; raise timeout= or {TIMEOUT_ENV} for slow networks",
            url=url or where,
            received=received,
        )


def _server(url: str) -> str:
    """Where a request went: an HTTP server's host and port, another store's ``scheme://bucket``."""
    parts = urlsplit(url)
    if not parts.netloc or parts.scheme in ("http", "https"):
        return parts.netloc or url
    return f"{parts.scheme}://{parts.netloc}"


class RetriedCalls:
    """Mixin for remote sources: :meth:`_call` runs one network operation under ``self._retry`` and
    the load's ``self._deadline``, with the source's own ``self._translated(file)`` turning library
    errors into otfload errors; long retries are announced through ``self._notice``, if any."""

    _retry: RetryPolicy
    _deadline: Deadline = NO_DEADLINE
    _notice: RetryNotice | None = None  # a source that announces long retries gives itself one

    @property
    def description(self) -> str:
        raise NotImplementedError

    def _translated(self, file: str | None, url: str = "") -> AbstractContextManager[None]:
        raise NotImplementedError

    def _call(
        self, fn: Callable[[], T], file: str | None = None, *, url: str = "", progress: Callable[[], int] | None = None
    ) -> T:
        def attempt() -> T:
            with self._translated(file, url):
                return fn()

        where = f"{self.description}: {file}" if file else self.description
        return self._retry.run(attempt, where, deadline=self._deadline, url=url, progress=progress, notice=self._notice)
