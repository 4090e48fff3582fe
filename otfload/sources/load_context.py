"""Work for one load on shared threads, run in the context of the code that submitted it.

A load's state -- its cancel token (:func:`~otfload.sources.retry.cancel_scope`) and its fetch meter
(:func:`~otfload.accounting.meter.metering`) -- rides context variables, set once where the load starts.
Pool threads serve many loads (the fetch threads serve the whole process): :func:`submit` runs each
piece of work in a copy of its submitter's context, so it works for the submitting load (two loads
at once on one pool keep their own tokens and meters) and no thread is re-seeded by hand;
:func:`map_in_context` is ``pool.map`` the same way. Every pool that runs a load's reads goes
through one of the two (the builders, the fetch threads, the header and small-value reads of
``otfload.index.checkpoint``, the shard cache's fills, the lm-eval backend's background load;
``tests/sources/test_pool_context.py``). Pools that only compile programs for a process-wide cache
(``place/device_hooks.py``, ``place/collective_route.py``) serve every load alike and read nothing.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import Executor, Future
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")
X = TypeVar("X")


def submit(pool: Executor, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> Future[T]:
    """``pool.submit(fn, *args, **kwargs)``, run in a copy of the calling context (the load it works for)."""
    return pool.submit(functools.partial(contextvars.copy_context().run, fn, *args, **kwargs))


def map_in_context(pool: Executor, fn: Callable[[X], T], items: Iterable[X]) -> list[T]:
    """``list(pool.map(fn, items))``, each call run in a copy of the calling context."""
    futures = [submit(pool, fn, item) for item in items]
    return [future.result() for future in futures]
