"""The benchmark harness still runs end to end (tiny checkpoints; the figures themselves are
measured by hand and recorded in docs/benchmarks.md, never asserted by a timed test)."""

import sys
from pathlib import Path

import pytest

from tests import forked

ROOT = Path(__file__).resolve().parents[2]


# The Mixtral-shaped run: otfload (its experts stacked) against the floor only; the other methods read
# every tensor alike whatever the checkpoint's shape, and run on the Llama-shaped one.
@pytest.mark.parametrize(("moe", "methods"), [(False, "floor,naive,loop,orbax,otfload"), (True, "floor,otfload")])
def test_bench_load_runs_every_method_and_prints_the_ratio_table(bench_checkpoint, moe, methods):
    kind = ["--moe"] if moe else []
    cmd = [sys.executable, "-m", "benchmarks.bench_load", "--size-gib", "0.02", "--repeat", "1",
           "--dir", str(bench_checkpoint(moe)), "--methods", methods]
    verify = [] if moe else ["--verify"]  # the bitwise check a GPU run starts with
    out = forked.run(cmd + kind + verify, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    for row in [*(f"| {m} |" for m in methods.split(",")), "otfload speed / floor"]:
        assert row in out.stdout, row
    if verify:
        assert "verify on cpu: otfload vs numpy, 12 leaves bitwise: all equal" in out.stdout


def test_h2d_routes_print_both_calls_of_each_route():
    cmd = [sys.executable, "-m", "benchmarks.h2d_routes", "--gib", "0.01", "--routes", "whole,pieces-64m-written"]
    out = forked.run(cmd, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith(("| whole", "| pieces"))]
    assert [r[1].strip() for r in rows] == ["whole", "pieces-64m-written"]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)
