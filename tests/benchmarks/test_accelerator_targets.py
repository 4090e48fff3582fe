"""The accelerator run's script works as its own dry run: on CPU devices `bench_load --accelerator-targets`
prints every limit and loader row (a method this machine lacks as "not measured", the DMA limit as
"unavailable" with the reason) and issue 30's verdict rows; the first-transfer probe prints its phases."""

import sys
from pathlib import Path

from tests import forked

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_prints_limits_loaders_and_verdicts(bench_checkpoint):
    cmd = [sys.executable, "-m", "benchmarks.bench_load", "--repeat", "1", "--dir", str(bench_checkpoint()),
           "--lenient", "--accelerator-targets", "--methods", "dma-put,fastsafetensors,otfload-staged,otfload-primed"]
    out = forked.run(cmd, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fastsafetensors left out" in out.stderr  # not installed here: reported, not fatal
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert "unavailable — CPU devices" in rows["dma-put"]
    assert "not measured" in rows["fastsafetensors"] and "not measured" in rows["floor-all"]
    assert "CPU devices: host buffers adopted" in rows["otfload-primed"]
    assert float(rows["otfload-primed"].split("|")[4]) > 0  # time to the first leaf
    assert any(k.startswith("warm, one transfer before: ≥ 8 GB/s") for k in rows)
    assert "not measured" in rows["warm: ≥ 3.5× fastsafetensors"]


def test_first_transfer_probe_prints_each_phase():
    cmd = [sys.executable, "-m", "benchmarks.first_transfer", "--variants", "compute-first"]
    out = forked.run(cmd, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    row = next(line for line in out.stdout.splitlines() if line.startswith("| compute-first"))
    assert row.count("|") == 9 and all(float(c) >= 0 for c in row.split("|")[3:-1])
