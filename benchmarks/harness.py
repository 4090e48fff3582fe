"""What the benchmarks' parents share: each run in a fresh child process that prints one JSON result
line, and the cells their tables repeat.

Kept free of JAX and otfload imports: a parent stays light, and the tunix benchmark's parent runs in
tunix's own venv.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence

RESULT_PREFIX = "BENCH_RESULT "


def report(result: Mapping) -> None:
    """Print a child's result as the line :func:`run_child` looks for."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(cmd: Sequence[str], env: Mapping[str, str] | None, what: str) -> dict:
    """Run ``cmd`` and return the result it :func:`report` ed; RuntimeError with the end of its output
    (``what`` failed) when it printed none."""
    proc = subprocess.run(list(cmd), env=None if env is None else dict(env), capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result: dict = json.loads(line[len(RESULT_PREFIX) :])
            return result
    raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def runs_cell(values: Sequence[float]) -> str:
    """Every run's figure, as a table cell lists them."""
    return ", ".join(f"{v:.2f}" for v in values)


def speed_cell(base: Mapping | None, result: Mapping) -> str:
    """How many times as fast as ``base`` ``result`` was, in wall and CPU seconds (empty without one)."""
    if base is None:
        return ""
    return f"{base['seconds'] / result['seconds']:.2f}×, {base['cpu_seconds'] / result['cpu_seconds']:.2f}×"
