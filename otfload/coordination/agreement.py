"""How the processes of one job agree before their collectives, and how long they wait for them.

Every process must join a collective in the same order: a process that chose differently would wait
forever in a reshard the others never run. An :class:`Agreement` is the meeting of one
multi-process load over the job's key-value store (:class:`~otfload.coordination.Coordinator`), in
two exchanges, each one small record per process:

1. **facts** (:meth:`Agreement.facts`), before anything is read: each process publishes the inputs
   of its choices (:class:`Facts`: a digest of its plan, its policy, its source kind and the
   fraction of its files resident). Different plans or policies end the load on every process with
   :class:`~otfload.errors.CollectiveMismatchError`; otherwise every process gets the same
   :class:`Agreed` facts to choose from.
2. **reshard** (:meth:`Agreement.before_collectives`), once every leaf is built and before the
   first collective: each publishes the leaves it will reshard, in order (or that it failed, and
   why). Different lists end the load with a :class:`~otfload.errors.CollectiveMismatchError`
   naming the first leaf that differs; a process that failed ends it with a
   :class:`~otfload.errors.CollectiveError` naming that process.

A process that does not publish within the bound (``OTFLOAD_COLLECTIVE_TIMEOUT`` seconds) ends the
load with :class:`~otfload.errors.CollectiveTimeoutError` naming the processes missing, and the
leaf; so does a collective that does not complete within the bound (:func:`run_bounded`: the
collectives run in one thread the loader watches). Never a hang.

Records live under ``otfload/agree/<mesh>/<round>/``: ``round`` counts this process's loads on that
mesh (it names the meeting place only; no choice reads it). A round given up after a timeout is
marked abandoned and later arrivals skip it, so that after one host's error all processes retry
into the same fresh round. What a load agrees on, and what it chooses from the agreed facts, is
:mod:`otfload.place.agree`'s.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from jax.sharding import Mesh

from otfload.coordination.coordinator import Coordinator
from otfload.errors import CollectiveError, CollectiveMismatchError, CollectiveTimeoutError

# Seconds a process waits for the others at an exchange, and for one collective to complete. The
# reshard exchange waits for the slowest process to finish reading; 600 s covers a host reading tens
# of GB more slowly than the others (1 GB/s cold disks) without letting a lost process hang the job.
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "OTFLOAD_COLLECTIVE_TIMEOUT"
KEY_PREFIX = "otfload/agree"

T = TypeVar("T")


def mesh_key(mesh: Mesh) -> str:
    """The same short name for ``mesh`` on every process: its axes and its devices' global ids."""
    text = json.dumps([list(mesh.axis_names), list(mesh.devices.shape), [d.id for d in mesh.devices.flat]])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Facts:
    """One process's inputs to its choices: its plan (digest), policy, source kind and page cache."""

    plan: str
    policy: str
    source: str  # "local" (files, read in pages) or "remote"
    resident: float | None  # local files: the fraction of their bytes in the page cache (None: unknown)


@dataclass(frozen=True)
class Agreed:
    """The facts every process chooses from: the policy, the source kind and, per process, the
    fraction of its local files resident."""

    policy: str
    source: str
    resident: tuple[float | None, ...]

    @property
    def processes(self) -> int:
        return len(self.resident)


# Per mesh, the next round this process joins: where it meets the others, never an input to a choice.
_rounds: dict[str, int] = {}
_rounds_lock = threading.Lock()


class Agreement:
    """The two exchanges of one multi-process load, and the bound on its collectives."""

    def __init__(self, coordinator: Coordinator, mesh: str, timeout_s: float, rounds: dict[str, int] | None = None):
        """``rounds``: this process's next round per mesh (default: the process's own table)."""
        self.coordinator = coordinator
        self.me = coordinator.process_index
        self.count = coordinator.process_count
        self.timeout_s = timeout_s
        self._mesh = mesh
        self._published: set[str] = set()
        rounds = _rounds if rounds is None else rounds
        with _rounds_lock:
            r = rounds.get(mesh, 0)
            while coordinator.wait_for(self._key(r, "abandoned"), 0.0) is not None:
                r += 1
            rounds[mesh] = r + 1
        self.round = r

    def _key(self, r: int, name: str) -> str:
        return f"{KEY_PREFIX}/{self._mesh}/{r}/{name}"

    def facts(self, mine: Facts) -> Agreed:
        """Exchange ``mine`` with every process; the agreed facts. Raises
        :class:`~otfload.errors.CollectiveMismatchError` if the plans or policies differ."""
        records = self._exchange("facts", asdict(mine), leaf=None)
        for field in ("plan", "policy", "source"):
            values = {q: r[field] for q, r in enumerate(records)}
            if len(set(values.values())) > 1:
                others = [q for q, v in values.items() if v != values[self.me]]
                raise CollectiveMismatchError(
                    f"the processes of this load disagree on its {field}: {_by_process(values)}; every process "
                    f"must load the same checkpoint on the same mesh with the same reshard policy", None, others)
        return Agreed(policy=mine.policy, source=mine.source, resident=tuple(r["resident"] for r in records))

    def before_collectives(self, leaves: Sequence[str]) -> None:
        """Exchange the leaves this process will reshard, in order; returns once every process will
        run the same collectives. Raises :class:`~otfload.errors.CollectiveMismatchError` naming the
        first leaf that differs, or :class:`~otfload.errors.CollectiveError` if a process failed."""
        first = leaves[0] if leaves else None
        records = self._exchange("reshard", {"leaves": list(leaves)}, leaf=first)
        failed = {q: r["failed"] for q, r in enumerate(records) if "failed" in r}
        if failed:
            q, why = next(iter(failed.items()))
            raise CollectiveError(f"process {q} failed before the reshards: {why}", first, sorted(failed))
        reference = records[0]["leaves"]  # every process compares with process 0: the same error everywhere
        for q, r in enumerate(records):
            theirs = r["leaves"]
            if theirs != reference:
                k = next((i for i, (a, b) in enumerate(zip(reference, theirs, strict=False)) if a != b),
                         min(len(reference), len(theirs)))
                leaf = reference[k] if k < len(reference) else theirs[k]
                raise CollectiveMismatchError(
                    f"leaf {leaf!r}: process 0 and process {q} would run different reshards from here "
                    f"(reshard #{k}: {_nth(reference, k)} against {_nth(theirs, k)})", leaf, [q])

    def abort(self, error: BaseException) -> None:
        """Tell the others, at the reshard exchange, that this process failed (they end at once)."""
        if "reshard" not in self._published:
            self._publish("reshard", {"failed": f"{type(error).__name__}: {error}"[:2000]})

    def run(self, steps: Sequence[tuple[str, Callable[[], T]]]) -> list[T]:
        """Run the collectives ``steps`` (``(leaf, call)``; each call returns once its collective has
        completed) in order, in one thread; raises :class:`~otfload.errors.CollectiveTimeoutError`
        naming the leaf if one does not complete within the bound."""
        return run_bounded(steps, self.timeout_s, self.me)

    def _publish(self, stage: str, value: Mapping[str, Any]) -> None:
        self._published.add(stage)
        self.coordinator.publish(self._key(self.round, f"{stage}/{self.me}"), json.dumps(value))

    def _exchange(self, stage: str, value: Mapping[str, Any], leaf: str | None) -> list[dict[str, Any]]:
        """Publish ``value``, then every process's record of ``stage`` (in process order)."""
        if stage not in self._published:
            self._publish(stage, value)
        deadline = time.monotonic() + self.timeout_s
        records: list[dict[str, Any] | None] = []
        for q in range(self.count):
            if q == self.me:
                records.append(dict(value))
                continue
            left = max(0.0, deadline - time.monotonic())
            got = self.coordinator.wait_for(self._key(self.round, f"{stage}/{q}"), left)
            records.append(None if got is None else json.loads(got))
        missing = [q for q, r in enumerate(records) if r is None]
        if missing:
            self.coordinator.publish(self._key(self.round, "abandoned"), str(self.me))
            where = f"the reshard of leaf {leaf!r}" if leaf else f"the {stage} exchange"
            raise CollectiveTimeoutError(
                f"process {self.me} waited {self.timeout_s:g} s for process(es) {missing} at {where} of this load "
                f"(round {self.round}); they did not arrive (failed, or loading something else). Raise "
                f"{TIMEOUT_ENV} if they are only slower", leaf, missing)
        return [r for r in records if r is not None]


def run_bounded(steps: Sequence[tuple[str, Callable[[], T]]], timeout_s: float, process: int = 0) -> list[T]:
    """``[call() for _, call in steps]`` in one daemon thread, watched: each step must complete within
    ``timeout_s`` of the previous one, else :class:`~otfload.errors.CollectiveTimeoutError` names its
    leaf (the thread is left to the collective; the load has ended)."""
    results: list[T] = []
    failure: list[BaseException] = []
    changed = threading.Condition()

    def work() -> None:
        try:
            for _, call in steps:
                value = call()
                with changed:
                    results.append(value)
                    changed.notify_all()
        except BaseException as e:  # handed to the waiting thread
            with changed:
                failure.append(e)
                changed.notify_all()

    if not steps:
        return []
    threading.Thread(target=work, name="otfload-collectives", daemon=True).start()
    def moved(done: int) -> Callable[[], bool]:
        return lambda: len(results) > done or bool(failure)

    with changed:
        while len(results) < len(steps) and not failure:
            done = len(results)
            if not changed.wait_for(moved(done), timeout=timeout_s):
                leaf = steps[done][0]
                raise CollectiveTimeoutError(
                    f"leaf {leaf!r}: its reshard (a collective of every process) did not complete within "
                    f"{timeout_s:g} s on process {process}: another process is not running it", leaf)
        if failure:
            raise failure[0]
    return results


def _by_process(values: Mapping[int, object]) -> str:
    groups: dict[str, list[int]] = {}
    for q, v in values.items():
        groups.setdefault(repr(v), []).append(q)
    return "; ".join(f"process(es) {qs}: {v}" for v, qs in groups.items())


def _nth(leaves: Sequence[str], k: int) -> str:
    return repr(leaves[k]) if k < len(leaves) else "none"
