"""Run the processes of a measured multi-process load (:mod:`tests.multihost.fetch_worker`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.multihost.launch import REPO_ROOT, wait_workers, worker_env
from tests.servers.net import free_port


def run_fetch_workers(spec: dict, processes: int, out: Path, timeout_s: float = 180.0) -> list[dict]:
    """Start one fetch worker per process, wait for all, return every ``proc<i>.json``."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "processes": processes, "port": free_port(), "out": str(out)}
    path = out / "spec.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "tests.multihost.fetch_worker", str(path)]
    procs = [
        subprocess.Popen([*cmd, str(i)], cwd=REPO_ROOT, env=worker_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for i in range(processes)
    ]
    wait_workers(procs, timeout_s)
    return [json.loads((out / f"proc{i}.json").read_text()) for i in range(processes)]
