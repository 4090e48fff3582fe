"""Start the JAX processes of one multi-process test run on localhost and collect what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.harness import DEVICE_COUNT_FLAG
from tests import forked
from tests.servers.net import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]


def worker_env() -> dict[str, str]:
    """The test process's environment without its 8-device XLA flag (workers set their own count); its
    other XLA flags (the tests' cheaper CPU codegen) stay."""
    env = dict(os.environ)
    flags = [f for f in env.pop("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO_ROOT), TF_CPP_MIN_LOG_LEVEL="2")
    return env


def join_cpu_job(spec: dict, pid: int) -> None:
    """In a worker: ``spec["local_devices"]`` CPU devices and, for a job of several processes, its
    ``jax.distributed`` coordinator on 127.0.0.1 (process ``pid``)."""
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", spec["local_devices"])  # before any backend use
    if spec["processes"] > 1:
        jax.distributed.initialize(f"127.0.0.1:{spec['port']}", num_processes=spec["processes"], process_id=pid,
                                   initialization_timeout=60)  # fmt: skip


def write_spec(spec: dict, processes: int, out: Path) -> Path:
    """Write ``spec`` (plus ``processes``, ``port``, ``out``) into ``out/spec.json``; its path."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "processes": processes, "port": free_port(), "out": str(out)}
    path = out / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def start_workers(spec: dict, processes: int, out: Path) -> list[subprocess.Popen]:
    """Write ``spec`` and start one worker per process, each a plain child of this process (for a test
    that polls or signals it)."""
    cmd = [sys.executable, "-m", "tests.multihost.worker", str(write_spec(spec, processes, out))]
    return [
        subprocess.Popen(
            [*cmd, str(i)], cwd=REPO_ROOT, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )  # fmt: skip
        for i in range(processes)
    ]


def fork_workers(module: str, spec: Path, processes: int) -> list[forked.Process]:
    """``python -m MODULE SPEC I`` for each process ``I``: fresh processes forked from tests.forked's
    server (the imports done once for all), stderr merged into stdout."""
    return [forked.Process([sys.executable, "-m", module, str(spec), str(i)], cwd=REPO_ROOT, env=worker_env(),
                           merge=True) for i in range(processes)]  # fmt: skip


def wait_workers(procs: Sequence[subprocess.Popen | forked.Process], timeout_s: float) -> list[str]:
    """Wait for every worker (killing all of them past ``timeout_s``); their output, Gloo lines removed.

    Raises ``AssertionError`` with the outputs if any worker failed or timed out.
    """
    outputs, failed = [], False
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
            text += f"\n[killed after {timeout_s}s]"
            failed = True
        failed |= p.returncode != 0
        outputs.append("\n".join(line for line in text.splitlines() if not line.startswith("[Gloo]")))
    assert not failed, "worker(s) failed:\n" + "\n----\n".join(outputs)
    return outputs


def run_workers(spec: dict, processes: int, out: Path, timeout_s: float = 90.0) -> list[dict]:
    """Run one job to completion; every process's ``proc<i>.json``."""
    wait_workers(fork_workers("tests.multihost.worker", write_spec(spec, processes, out), processes), timeout_s)
    return [json.loads((out / f"proc{i}.json").read_text()) for i in range(processes)]


def run_scenarios(spec: dict, scenarios: dict[str, dict], processes: int, out: Path, timeout_s: float) -> dict:
    """Run the ``scenarios`` (``{name: keys}``, in order) in one job to completion; for each, every
    process's ``proc<i>.json`` (the worker writes a scenario's files into ``out/<name>``)."""
    path = write_spec({**spec, "scenarios": scenarios}, processes, out)
    wait_workers(fork_workers("tests.multihost.worker", path, processes), timeout_s)
    return {name: [json.loads((out / name / f"proc{i}.json").read_text()) for i in range(processes)]
            for name in scenarios}  # fmt: skip
