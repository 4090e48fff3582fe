"""The model benchmark's harness runs end to end on tiny shapes (its figures are measured by hand for
docs/benchmarks.md, never asserted by a timed test). docs/evaluation.md's code blocks run in
tests/docs/test_docs.py, with every other page's."""

import re
import subprocess
import sys
from pathlib import Path

from benchmarks.harness import child_env

ROOT = Path(__file__).resolve().parents[2]


def test_bench_models_smoke_prints_every_table():
    env = child_env(1)  # one device, as the benchmark runs; the suite's cheaper compiling (conftest.py) kept
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_models", "--smoke", "--repeat", "1"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for row in ["| 64 | dense |", "| 64 | blocks |", "| 64 | ragged |", "| blocks |", "| 256 | chunked |",
                "| 256 | eager |", "| 256 | dpa |", "recompute / cache"]:
        assert row in out.stdout, row
    blocks = re.search(r"\| 64 \| blocks \| [\d.]+ \| [\d.]+ \| [\d.]+ \| ([\d.]+) \|", out.stdout)
    assert blocks and float(blocks.group(1)) < 0.6  # top 4 of 16 experts: well under the dense FLOPs
