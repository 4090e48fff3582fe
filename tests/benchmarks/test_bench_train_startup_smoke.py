"""``benchmarks.bench_train_startup`` still runs both ways on a tiny checkpoint and reports
consistent milestones (the timings themselves are measured by hand for docs/benchmarks.md, never
asserted)."""

import os
import sys
from pathlib import Path

import pytest

from benchmarks.harness import result_of
from tests import forked

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("mode", "mesh"), [("sequential", "fsdp=2,tp=4"), ("overlapped", "fsdp=2,tp=4"),
                                            ("overlapped", "")])  # "": every device on fsdp (an accelerator host)
def test_child_runs_to_the_first_step(tiny_checkpoints, mode, mesh):
    path, _ = tiny_checkpoints("llama")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = forked.run([sys.executable, "-m", "benchmarks.bench_train_startup", "--child", mode, str(path), mesh],
                     cwd=ROOT, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    times = result_of(out.stdout)
    assert 0 < times["load"] <= times["ready"] < times["first_step"]
    assert 0 < times["compile"] <= times["ready"]
