"""Remote loading: gs:// throughput against gcsfs's whole-file ``cat``, and bytes read per process.

    python -m benchmarks.bench_remote [--size-gib 0.25] [--shard-mb 64] [--repeat 3] [--out docs/benchmarks_remote.md]

Everything runs against the real fake-gcs-server (in-memory backend) on 127.0.0.1, so the numbers
measure the client side (request handling, parallelism, copies), not a network:

1. one process, 8 simulated CPU devices (``fsdp=2, tp=4``): the same safetensors bytes read by
   ``gcsfs.cat`` of whole files (the floor), by ``otfload.from_pretrained("gs://...")`` (range
   reads, end to end: listing, headers, plan, reads, placement), and through a :class:`ShardCache`
   (fill from gs:// into a local directory, then load from it);
2. 1, 2 and 4 JAX processes (2 CPU devices each, ``fsdp=processes, tp=2``) loading through one
   shared shard cache: the bytes each process fetched from gs:// and read from the cache, against
   its ideal share (the source bytes of the shards its devices hold).
"""

from __future__ import annotations

from benchmarks import harness

harness.simulate_cpu_devices(8)

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import otfload  # noqa: E402
from benchmarks.make_checkpoint import choose_dims, write_checkpoint  # noqa: E402
from benchmarks.target import bench_mesh  # noqa: E402
from otfload.cache import ShardCache  # noqa: E402
from otfload.sources import open_source  # noqa: E402
from tests.multihost.launch import run_workers  # noqa: E402
from tests.servers.gcs_server import GcsServer  # noqa: E402

BUCKET = "otfload-bench"


def throughput(gcs: GcsServer, url: str, tensor_files: list[str], tensor_bytes: int, repeat: int) -> list[tuple]:
    """``(method, median seconds, GB/s of tensor bytes, ratio to cat)`` rows."""
    fs = gcs.filesystem()
    paths = [f"{url.removeprefix('gs://')}/{f}" for f in tensor_files]
    mesh = bench_mesh(8)
    opts = {"storage_options": gcs.storage_options}

    def load(workers: int):
        return lambda: otfload.from_pretrained(url, mesh=mesh, workers=workers, progress=False, **opts)

    def cached():
        with tempfile.TemporaryDirectory() as d:
            cache = ShardCache(open_source(url, **opts), d)
            otfload.from_pretrained(cache, mesh=mesh, progress=False)

    methods = {
        "gcsfs cat, whole files (floor)": lambda: fs.cat(paths),
        "otfload gs:// range reads, workers=2": load(2),
        "otfload gs:// range reads, workers=8": load(8),
        "otfload via ShardCache (fill + load)": cached,
    }
    load(2)()  # compile and warm once
    seconds = {name: statistics.median(harness.times(fn, repeat, warmup=0)) for name, fn in methods.items()}
    floor = seconds["gcsfs cat, whole files (floor)"]
    return [(name, s, tensor_bytes / s / 1e9, floor / s) for name, s in seconds.items()]


def per_process(gcs: GcsServer, url: str, counts: list[int], work: Path) -> list[tuple]:
    """``(processes, process, fetched MB, read MB, ideal MB, read / ideal)`` rows."""
    rows = []
    for n in counts:
        spec = {"mode": "load", "gather": False, "local_devices": 2, "source": url, "timeout_s": 300,
                "source_options": {"storage_options": gcs.storage_options},
                "cache_dir": str(work / f"cache{n}")}  # fmt: skip
        sizes = {f: (work / "ckpt" / f).stat().st_size for f in os.listdir(work / "ckpt")}
        for r in run_workers(spec, n, work / f"out{n}", timeout_s=600):
            fetched = sum(sizes[f] for f in r["fetched"])
            rows.append((n, r["process"], fetched / 1e6, r["bytes_read"] / 1e6, r["ideal_bytes"] / 1e6,
                         r["bytes_read"] / r["ideal_bytes"]))  # fmt: skip
    return rows


def report(args, dims, files: int, tensor_bytes: int, rows: list[tuple], proc_rows: list[tuple]) -> str:
    lines = [
        "# Remote loading benchmark",
        "",
        f"Command: `python -m benchmarks.bench_remote --size-gib {args.size_gib} --shard-mb {args.shard_mb} "
        f"--repeat {args.repeat}`",
        "",
        f"Checkpoint: synthetic Llama, hidden {dims.hidden}, {dims.layers} layers, bf16, "
        f"{tensor_bytes / 1e6:.0f} MB of tensors in {files} files, in the real fake-gcs-server "
        "(in-memory backend) on 127.0.0.1; client and server share the machine's 2 vCPUs.",
        "",
        f"## Throughput, one process, 8 CPU devices (fsdp=2, tp=4), median of {args.repeat}",
        "",
        harness.table(["method", "seconds", "GB/s", "ratio to cat"],
                      [[name, f"{s:.2f}", f"{gbps:.3f}", f"{ratio:.2f}"] for name, s, gbps, ratio in rows]),
        "",
        "Target: otfload gs:// load ≥ 0.8 × the `cat` floor of the same bytes. The otfload rows are end to end",
        "(listing, headers, plan, reads, hooks, placement on 8 devices); `cat` only moves bytes into memory.",
        "",
        "## Bytes per process through one shared shard cache (2 CPU devices per process, fsdp=processes, tp=2)",
        "",
        harness.table(["processes", "process", "fetched from gs:// (MB)", "read from cache (MB)", "ideal share (MB)",
                       "read / ideal"], [[n, p, f"{f:.1f}", f"{r:.1f}", f"{i:.1f}", f"{q:.3f}"]
                                         for n, p, f, r, i, q in proc_rows], left=0),
        "",
        "Each file is fetched from gs:// by exactly one process (the fetched column sums to the checkpoint);",
        "each process then reads only the byte ranges of the shards its devices hold (ideal: the source",
        "bytes of its distinct shards; replicated leaves count fully for every process).",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--shard-mb", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown report here")
    args = parser.parse_args(argv)
    dims = choose_dims(int(args.size_gib * 2**30))
    with tempfile.TemporaryDirectory() as tmp, GcsServer() as gcs:
        work = Path(tmp)
        ckpt = write_checkpoint(work / "ckpt", dims, shard_bytes=args.shard_mb * 10**6)
        gcs.filesystem().mkdir(BUCKET)
        url = gcs.upload_dir(ckpt, BUCKET, "llama")
        tensor_files = sorted(p.name for p in ckpt.glob("*.safetensors"))
        tensor_bytes = sum((ckpt / f).stat().st_size for f in tensor_files)
        rows = throughput(gcs, url, tensor_files, tensor_bytes, args.repeat)
        proc_rows = per_process(gcs, url, [int(n) for n in args.processes.split(",")], work)
    text = report(args, dims, len(tensor_files), tensor_bytes, rows, proc_rows)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
