"""The cold-cache mode of the load benchmark runs end to end: every run starts with the checkpoint
out of the page cache (checked with ``mincore`` in the run itself), reads it from the disk
(``/proc/self/io``), and the cold floors and ratios are printed. Timings are never asserted."""

import mmap
import re
import sys
from pathlib import Path

import numpy as np

from tests import forked

ROOT = Path(__file__).resolve().parents[2]


def test_bench_load_cold_mode_reports_floors_disk_bytes_and_residency(bench_checkpoint):
    checkpoint = bench_checkpoint()
    cmd = [sys.executable, "-m", "benchmarks.bench_load", "--repeat", "1", "--dir", str(checkpoint),
           # only the checkpoint's pages are dropped
           "--cold-files", "--methods", "cat,dd,fromfile,direct,direct4,otfload"]
    out = forked.run(cmd, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "cold (before each run: posix_fadvise(DONTNEED) per file (--cold-files))" in out.stdout
    size = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
    for method in ("cat", "dd", "fromfile", "direct", "direct4", "otfload"):
        row = next(line for line in out.stdout.splitlines() if line.startswith(f"| {method} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        disk_gb, resident = float(cells[-3]), cells[-1]
        assert int(resident.rstrip("%")) <= 5, row  # the run started cold ...
        assert disk_gb * 1e9 >= 0.9 * size, row  # ... and read (about) every byte from the disk
    for base in ("fromfile", "cat", "dd", "direct4"):
        assert re.search(rf"\| otfload speed / {base} \| [0-9.]+ \|", out.stdout), base


def test_cold_strategies_copy_every_tensor_exactly(tmp_path):
    from benchmarks.cold_strategies import Strategies, load_order
    from tests.synthetic import write_checkpoint

    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{i}.{w}.weight": rng.standard_normal((64, 96), dtype=np.float32)
               for i in range(3) for w in ("q", "k")}
    directory = write_checkpoint(tmp_path / "c", tensors, files=2)
    order = load_order(directory)
    assert [key for key, *_ in order] == sorted(tensors, key=lambda k: (k.split(".")[-2], k))  # leaf by leaf
    strategies = Strategies(directory)
    strategies.maps = {f: mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for f, fd in strategies.fds.items()}
    for tensor in order:
        key, file, offset, length = tensor
        expected = tensors[key].tobytes()
        assert np.fromfile(directory / file, np.uint8, length, offset=offset).tobytes() == expected
        for method in ("m_copy", "p_copy", "p_direct"):
            assert getattr(strategies, method)(tensor).tobytes() == expected, (method, key)
    wall, cpu = strategies.run("p_copy", 2, ahead=True)
    assert wall > 0 and cpu >= 0
