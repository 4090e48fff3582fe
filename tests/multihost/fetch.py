"""Run the processes of a measured multi-process load (:mod:`tests.multihost.fetch_worker`)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.multihost.launch import fork_workers, wait_workers, write_spec


def run_fetch_workers(spec: dict, processes: int, out: Path, timeout_s: float = 180.0) -> list[dict]:
    """Start one fetch worker per process (forked: :func:`~tests.multihost.launch.fork_workers`), wait for
    all, return every ``proc<i>.json``."""
    wait_workers(fork_workers("tests.multihost.fetch_worker", write_spec(spec, processes, out), processes), timeout_s)
    return [json.loads((out / f"proc{i}.json").read_text()) for i in range(processes)]
