"""How the processes of one job tell each other that a cache file is committed.

The owner of a file publishes a status under a key once the file is committed (``"ok"``) or failed
(``"error: ..."``); the others wait for that key with a deadline. Across processes this is JAX's
distributed key-value store (``jax.distributed.initialize`` must have run); in one process, a dict.
"""

from __future__ import annotations

import threading
from typing import Protocol


class Coordinator(Protocol):
    """The processes of one job: who this one is, and a key-value store they share."""

    process_index: int
    process_count: int

    def publish(self, key: str, value: str) -> None:
        """Set ``key`` to ``value`` for every process to see."""
        ...

    def wait_for(self, key: str, timeout_s: float) -> str | None:
        """The value of ``key`` once some process has published it, or None after ``timeout_s``."""
        ...


class LocalCoordinator:
    """A key-value store in this process's memory: the coordinator of a single-process job."""

    def __init__(self, process_index: int = 0, process_count: int = 1):
        self.process_index = process_index
        self.process_count = process_count
        self._values: dict[str, str] = {}
        self._changed = threading.Condition()

    def publish(self, key: str, value: str) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def wait_for(self, key: str, timeout_s: float) -> str | None:
        with self._changed:
            self._changed.wait_for(lambda: key in self._values, timeout=max(0.0, timeout_s))
            return self._values.get(key)


class JaxCoordinator:
    """The key-value store of ``jax.distributed`` (its coordination service)."""

    def __init__(self) -> None:
        # jax._src on purpose: JAX has no public API for the coordination service's key-value client
        # (jax 0.10: jax.distributed offers initialize/is_initialized/shutdown only), nor for the
        # process id and count without starting the backend (jax.process_index() starts it).
        from jax._src.distributed import global_state

        if global_state.client is None:
            raise RuntimeError("jax.distributed.initialize() has not been called in this process")
        self._client = global_state.client
        # Not jax.process_index(): that starts the backend, a collective step a peer may not be at yet.
        self.process_index = global_state.process_id
        self.process_count = global_state.num_processes

    def publish(self, key: str, value: str) -> None:
        self._client.key_value_set(key, value, allow_overwrite=True)

    def wait_for(self, key: str, timeout_s: float) -> str | None:
        try:
            value: str = self._client.blocking_key_value_get(key, max(1, int(timeout_s * 1000)))
            return value
        except Exception as e:  # jaxlib raises its runtime error type with a gRPC status in the text
            if "DEADLINE_EXCEEDED" in str(e):
                return None
            raise


def current_coordinator() -> Coordinator:
    """The JAX distributed store when this is one of several processes, else a local one."""
    from jax._src.distributed import global_state  # the process count without starting the backend: no public API

    multi = global_state.client is not None and global_state.num_processes > 1
    return JaxCoordinator() if multi else LocalCoordinator()
