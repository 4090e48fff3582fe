"""Work for one load on shared threads, run in the context of the code that submitted it.

A load's state -- its cancel token (:func:`~otfload.sources.retry.cancel_scope`) and its fetch meter
(:func:`~otfload.accounting.meter.metering`) -- rides context variables, set once where the load starts.
Pool threads serve many loads (the fetch threads serve the whole process): :func:`submit` runs each
piece of work in a copy of its submitter's context, so it works for the submitting load (two loads
at once on one pool keep their own tokens and meters) and no thread is re-seeded by hand.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")


def submit(pool: Executor, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """``pool.submit(fn, *args, **kwargs)``, run in a copy of the calling context (the load it works for)."""
    return pool.submit(functools.partial(contextvars.copy_context().run, fn, *args, **kwargs))
