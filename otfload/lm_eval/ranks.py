"""lm_eval's multi-process protocol over ``jax.distributed``: ranks, gathers and barriers.

With several processes, ``lm_eval.evaluate`` gives each *rank* every ``world_size``-th document of
each task, pads the request lists to one length (it all-gathers their counts), runs them, waits at a
barrier after each request type and gathers the per-document metrics (and logged samples) to rank 0,
which alone aggregates them and gets the results. Its ``hf`` backend does this with ``accelerate``;
here the ranks are ``jax.distributed``'s processes and the exchanges go through the job's key-value
store (its coordination service, :mod:`otfload.coordination`), so no device and no torch
process group takes part: each process scores its share on its own devices.

Every process makes the same exchanges in the same order (lm_eval's protocol does), so the n-th
exchange of a :class:`Ranks` has the same key on every process. Values are pickled, base64-encoded
and cut into chunks the store takes; a process that does not arrive within the bound (one hour, or
``OTFLOAD_COLLECTIVE_TIMEOUT`` seconds) ends the job with a
:class:`~otfload.errors.CollectiveTimeoutError` naming it, instead of a hang.

A process that fails stops taking part at once, not an hour later: lm_eval raises on a rank given no
document of a task (``--limit`` below the process count), before that rank's first exchange. Such a
process says so in the store (:meth:`Ranks.leave`, called when ``otfload lm-eval`` fails and when the
process exits), and a wait for it checks that mark every :data:`LEFT_POLL_S` seconds: the others end
with a :class:`~otfload.errors.CollectiveError` naming it and its reason.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import itertools
import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from otfload.coordination import Coordinator, current_coordinator
from otfload.coordination.agreement import TIMEOUT_ENV
from otfload.errors import CollectiveError, CollectiveTimeoutError, InvalidOptionError
from otfload.options.environment import environment

KEY_PREFIX = "otfload/lm_eval"
# An evaluation's processes meet at a barrier after each request type: the fastest waits for the
# slowest to score its share, which on a long task takes far longer than a load's exchanges.
DEFAULT_TIMEOUT_S = 3600.0
CHUNK_CHARS = 1 << 20  # per key: well under the coordination service's message limit (4 MiB)
# A wait looks this often for the mark of a process that left the job: one extra store lookup a
# second costs nothing next to scoring, and a failed process stops the others within a second.
LEFT_POLL_S = 1.0

# How a process names the job it joins (``jax.distributed.initialize``'s arguments), as lm_eval's
# ``model_args`` spell them; the command line's flags are the same with dashes.
JOB_ARGS = ("coordinator", "num_processes", "process_id")

# The n-th Ranks built in a process meets the n-th of every other process (they build theirs in order).
_jobs = itertools.count()
_jobs_lock = threading.Lock()


def join_job(coordinator: str | None, num_processes: int | None, process_id: int | None,
             names: Sequence[str] = JOB_ARGS) -> None:
    """``jax.distributed.initialize(coordinator, num_processes, process_id)`` when all three are
    given (none: nothing to join). ``names`` are the three as the caller's user spells them (flags,
    ``model_args``), for the errors."""
    given = (coordinator, num_processes, process_id)
    if all(v is None for v in given):
        return
    if any(v is None for v in given):
        raise InvalidOptionError(f"{', '.join(names[:2])} and {names[2]} go together: a process joins a job "
                                 "by all three")
    assert num_processes is not None and process_id is not None
    if not 0 <= int(process_id) < int(num_processes):
        raise InvalidOptionError(f"{names[2]} {process_id}: expected 0 to {int(num_processes) - 1}")
    import jax

    jax.distributed.initialize(coordinator, num_processes=int(num_processes), process_id=int(process_id))


class Ranks:
    """This process's rank among the job's ``world_size`` processes, and lm_eval's exchanges between them.

    ``coordinator`` defaults to the job's (``jax.distributed``'s key-value store, or this process
    alone); ``timeout_s`` bounds each wait for another process; ``job`` names the exchanges' keys,
    the same on every process (default: the n-th ``Ranks`` of this process meets the n-th of the others).
    """

    def __init__(self, coordinator: Coordinator | None = None, timeout_s: float | None = None,
                 job: str | None = None) -> None:
        self.coordinator = current_coordinator() if coordinator is None else coordinator
        self.rank = self.coordinator.process_index
        self.world_size = self.coordinator.process_count
        if timeout_s is None:
            timeout_s = environment().collective_timeout or DEFAULT_TIMEOUT_S
        self.timeout_s = timeout_s
        if job is None:
            with _jobs_lock:
                job = str(next(_jobs))
        self._space = f"{KEY_PREFIX}/{job}"
        self._exchanges = itertools.count()
        self._left = False
        if self.world_size > 1:
            atexit.register(self.leave, "its process exited")  # whatever ended it: the others stop waiting

    def leave(self, reason: str) -> None:
        """Tell the other processes that this one takes no further part in the job (``reason`` goes
        into their error). Once per process; harmless when the store is already gone."""
        if self._left or self.world_size == 1:
            return
        self._left = True
        with contextlib.suppress(Exception):  # at exit the coordination service may be shut down
            self.coordinator.publish(self._left_key(self.rank), reason)

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every process's ``obj``, by rank."""
        if self.world_size == 1:
            return [obj]
        key = self._next_key()
        self._publish(key, obj)
        return [obj if q == self.rank else self._read(key, q) for q in range(self.world_size)]

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every process's ``obj`` by rank on process ``dst``; None on the others."""
        if self.world_size == 1:
            return [obj]
        key = self._next_key()
        if self.rank != dst:
            self._publish(key, obj)
            return None
        return [obj if q == dst else self._read(key, q) for q in range(self.world_size)]

    def barrier(self) -> None:
        """Return once every process has reached its barrier of the same number."""
        self.all_gather_object(None)

    def all_gather(self, tensor: Any) -> Any:
        """lm_eval's ``all_gather`` of a (torch) tensor: every process's, joined along the first
        dimension (a scalar counting as one element), as a tensor of the same kind."""
        parts = self.all_gather_object(np.asarray(tensor.detach().cpu()))
        return tensor.new_tensor(np.concatenate([np.atleast_1d(p) for p in parts]))

    # --- the store --------------------------------------------------------------------------------

    def _next_key(self) -> str:
        return f"{self._space}/{next(self._exchanges)}"

    def _publish(self, key: str, obj: Any) -> None:
        text = base64.b64encode(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).decode("ascii")
        chunks = [text[i : i + CHUNK_CHARS] for i in range(0, len(text), CHUNK_CHARS)] or [""]
        for i, chunk in enumerate(chunks):
            self.coordinator.publish(f"{key}/{self.rank}/{i}", chunk)
        self.coordinator.publish(f"{key}/{self.rank}/chunks", str(len(chunks)))  # last: the others read on this

    def _read(self, key: str, process: int) -> Any:
        count = int(self._wait(f"{key}/{process}/chunks", process))
        text = "".join(self._wait(f"{key}/{process}/{i}", process) for i in range(count))
        return pickle.loads(base64.b64decode(text))  # noqa: S301  (written by this job's own processes)

    def _wait(self, key: str, process: int) -> str:
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            value = self.coordinator.wait_for(key, min(LEFT_POLL_S, max(0.0, remaining)))
            if value is not None:
                return value
            reason = self.coordinator.wait_for(self._left_key(process), 0.0)
            if reason is not None:
                raise CollectiveError(f"lm_eval: process {process} left the job before exchange {key!r}: {reason}",
                                      None, [process])
            if remaining <= 0:
                raise CollectiveTimeoutError(f"lm_eval: process {process} did not reach exchange {key!r} within "
                                             f"{self.timeout_s:g} s ({TIMEOUT_ENV} sets the bound)", None, [process])

    def _left_key(self, process: int) -> str:
        return f"{self._space}/left/{process}"
