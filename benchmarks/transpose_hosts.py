"""``[in, out]`` loads on 4 processes × 2 devices: otfload against the tunix-style loader (issue 19 §3).

    python -m benchmarks.transpose_hosts [--size-gib 0.5] [--repeat 2] [--warm]

Real multi-process JAX jobs (``jax.distributed`` on 127.0.0.1, 4 processes of 2 CPU devices, mesh
``fsdp=2 × tp=4``) load the unscanned Linen-style ``[in, out]`` tree of ``otfload.mappings.linen_llama``
(what tunix's models hold) from the Llama-shaped bf16 checkpoint of ``benchmarks.make_checkpoint``:

* ``otfload`` — ``otfload.load_params`` (each process reads the boxes its devices hold);
* ``tunix_style`` — :func:`benchmarks.bench_transpose.tunix_style_load`: every file mapped, every
  tensor a transposed view, ``jax.device_put(view, sharding)`` per leaf (JAX copies the process's
  shards out of the view: the pages those shards touch are read).

Each process reads its own copy of the checkpoint (separate hosts share no page cache), dropped from
the page cache before every run unless ``--warm`` (``posix_fadvise(DONTNEED)``). Per run: the slowest
process's seconds, and every process's ``/proc/self/io`` ``read_bytes`` summed over the checkpoint's
bytes (4.0: each process read all of it). Methods alternate run by run; medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

PROCESSES, LOCAL_DEVICES = 4, 2
MESH = {"fsdp": 2, "tp": 4}
METHODS = ("otfload", "tunix_style")


def worker(spec_path: str, pid: int) -> None:
    """One process of one run: load, time it, count the bytes the kernel read; ``proc<pid>.json``."""
    import jax

    spec = json.loads(Path(spec_path).read_text())
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    jax.distributed.initialize(f"127.0.0.1:{spec['port']}", num_processes=PROCESSES, process_id=pid,
                               initialization_timeout=60)  # fmt: skip
    try:
        import numpy as np
        from jax.experimental.multihost_utils import sync_global_devices
        from jax.sharding import Mesh

        import otfload
        from benchmarks.bench_transpose import tunix_style_load
        from otfload.mappings import linen_llama as mt

        directory = Path(spec["dirs"][pid])
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
        mesh = Mesh(np.array(devices).reshape(tuple(MESH.values())), tuple(MESH))
        config = json.loads((directory / "config.json").read_text())
        abstract = mt.abstract_params(config, mesh, np.dtype(jax.numpy.bfloat16), scan_layers=False)
        if spec["cold"]:
            harness.drop_caches(directory, files_only=True)
        sync_global_devices("transpose-hosts-start")
        before, start = harness.proc_io().get("read_bytes", 0), time.perf_counter()
        cpu_start = harness.cpu_seconds()
        if spec["method"] == "tunix_style":
            loaded = tunix_style_load(directory, abstract, config)
        else:
            loaded = otfload.load_params(directory, abstract, mt.TABLE, mesh=mesh, progress=False)
        jax.block_until_ready(loaded)
        result = {"seconds": time.perf_counter() - start, "cpu_seconds": harness.cpu_seconds() - cpu_start,
                  "read_bytes": harness.proc_io().get("read_bytes", 0) - before}  # fmt: skip
        sync_global_devices("transpose-hosts-end")
        (Path(spec["out"]) / f"proc{pid}.json").write_text(json.dumps(result))
    finally:
        jax.distributed.shutdown()


def run(method: str, dirs: list[Path], cold: bool, out: Path) -> dict:
    """One run of ``method`` on every process; the slowest process's seconds and all bytes read."""
    from tests.multihost.launch import REPO_ROOT, wait_workers, worker_env
    from tests.servers.net import free_port

    out.mkdir(parents=True, exist_ok=True)
    spec = out / "spec.json"
    spec.write_text(json.dumps({"method": method, "dirs": [str(d) for d in dirs], "cold": cold, "port": free_port(),
                                "out": str(out)}))  # fmt: skip
    cmd = [sys.executable, "-m", "benchmarks.transpose_hosts", "--worker", str(spec)]
    procs = [subprocess.Popen([*cmd, str(i)], cwd=REPO_ROOT, env=worker_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(PROCESSES)]  # fmt: skip
    wait_workers(procs, 600)
    results = [json.loads((out / f"proc{i}.json").read_text()) for i in range(PROCESSES)]
    return {"seconds": max(r["seconds"] for r in results), "cpu_seconds": sum(r["cpu_seconds"] for r in results),
            "read_bytes": sum(r["read_bytes"] for r in results)}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="leave the copies in the page cache")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker[0], int(args.worker[1]))
        return
    from benchmarks.make_checkpoint import ensure_checkpoint

    source = ensure_checkpoint(args.size_gib, moe=False)
    checkpoint = harness.tensor_bytes(source)
    with tempfile.TemporaryDirectory(dir=source.parent) as tmp:
        dirs = [Path(shutil.copytree(source, Path(tmp) / f"copy{i}")) for i in range(PROCESSES)]  # own inodes
        outs = (Path(tmp) / f"run-{i}" for i in range(len(METHODS) * args.repeat))
        runs = harness.rounds(METHODS, args.repeat, lambda m: run(m, dirs, not args.warm, next(outs)),
                              line=lambda r: f"{harness.progress(r)}  read {r['read_bytes'] / checkpoint:4.2f} x "
                              "checkpoint")  # fmt: skip
    cache = "warm page cache" if args.warm else "cold: each process's own copy dropped from the page cache"
    print(f"\n{PROCESSES} processes × {LOCAL_DEVICES} devices, mesh fsdp=2 × tp=4, {checkpoint / 1e9:.3f} GB "
          f"checkpoint, {cache}, medians of {args.repeat}; {harness.load_line()}\n")  # fmt: skip
    medians = {m: harness.summarize(rs, ("read_bytes",)) for m, rs in runs.items()}
    rows = [[m, f"{r['seconds']:.2f}", harness.runs_cell(r["all_seconds"]), f"{r['cpu_seconds']:.2f}",
             f"{r['read_bytes'] / checkpoint:.2f}"] for m, r in medians.items()]  # fmt: skip
    print(harness.table(["method", "seconds (slowest process)", "runs (s)", "CPU s (all processes)",
                         "read by all / checkpoint"], rows))  # fmt: skip
    ratio = medians["tunix_style"]["seconds"] / medians["otfload"]["seconds"]
    print(f"\notfload / tunix_style: {ratio:.2f}× (target ≥ 2×)")


if __name__ == "__main__":
    main()
