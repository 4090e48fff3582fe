"""Bytes each process really fetches, against its ideal share (issue 17).

    python -m benchmarks.bench_fetch [--size-gib 0.71] [--policies never,auto,always]
        [--meshes fsdp=8,fsdp=2:tp=4] [--sources local,hub] [--drop-caches] [--pread] [--out FILE]

Real 4-process × 2-device CPU jobs (``jax.distributed`` on 127.0.0.1, :mod:`tests.multihost.fetch_worker`)
load one synthetic bf16 Llama on each mesh of ``--meshes`` (default ``fsdp=8`` and ``fsdp=2, tp=4``;
also ``tp=8``, ``fsdp=4, tp=2``), from

* **local files, cold**: each process reads its own copy (separate hosts share no page cache), evicted
  from the page cache first (``posix_fadvise(DONTNEED)``; with ``--drop-caches``, as root, the whole
  page cache is dropped too: ``echo 1 > /proc/sys/vm/drop_caches``); the kernel's ``/proc/self/io``
  ``read_bytes`` says what was fetched from disk. Cold files are read with ``O_DIRECT`` where the file
  system allows it (``$OTFLOAD_DIRECT_IO=0``: through the page cache); ``--pread``: with ``preadv``
  instead of a mapping;
* **local files, warm** (``--sources warm``): the same copies read whole by each process just before
  its load, so every page is resident; the route ``auto`` takes (and its seconds) against ``never`` and ``always``;
* **the Hub**: the test Hub server (tests/servers/hub_server.py) counts the body bytes it sends.

For each reshard policy (``never``: read each shard's box in place; ``auto``: the time model of
otfload/place/collective_route.py; ``always``: read every leaf it can as a band in the storage layout and
reshard on the devices) it records, per process: the route the load took and why (agreed by every
process: :mod:`otfload.place.agree`), the report's fetched bytes and requests, the kernel's
(local) or the server's (Hub, all processes together) count, the ideal share and the load's seconds;
and per job the bytes all processes read together over the checkpoint's bytes (the kernel's counts for
local files, the server's for the Hub): 1.00 is each byte from the source once, cluster-wide.
"""

from __future__ import annotations

from benchmarks import harness

harness.simulate_cpu_devices(8)  # the planned rows

import argparse  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks.make_checkpoint import choose_dims, write_checkpoint  # noqa: E402
from tests.multihost.fetch import run_fetch_workers  # noqa: E402
from tests.multihost.fetch_worker import evict  # noqa: E402
from tests.servers.hub_server import HubServer  # noqa: E402

PROCESSES, LOCAL_DEVICES = 4, 2
MESHES = {"fsdp=8": {"fsdp": 8}, "fsdp=2, tp=4": {"fsdp": 2, "tp": 4}, "fsdp=4, tp=2": {"fsdp": 4, "tp": 2},
          "tp=8": {"tp": 8}}
DEFAULT_MESHES = "fsdp=8,fsdp=2:tp=4"


def parse_meshes(text: str) -> dict[str, dict[str, int]]:
    """``"fsdp=8,fsdp=2:tp=4"`` → the named meshes (``:`` joins the axes of one mesh)."""
    names = [m.replace(":", ", ") for m in text.split(",")]
    unknown = [n for n in names if n not in MESHES]
    if unknown:
        raise SystemExit(f"unknown mesh(es) {unknown}: expected some of {list(MESHES)} (axes joined by ':')")
    return {n: MESHES[n] for n in names}


def run(spec: dict, out: Path) -> list[dict]:
    return run_fetch_workers({"local_devices": LOCAL_DEVICES, **spec}, PROCESSES, out, timeout_s=1800)


def drop_page_cache() -> None:
    """Drop the whole page cache (root only): every file cold, not just the copies evicted. Then read
    JAX's and jaxlib's own files back: the 4 processes share one page cache, so otherwise the first to
    touch a code page of XLA (compiling the reshards) is counted for reading it (20-25 MB seen)."""
    import jax
    import jaxlib

    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")
    for package in (jax, jaxlib):
        for path in Path(package.__file__).parent.rglob("*"):
            if path.is_file():
                path.read_bytes()


def local_kind(mmap: bool) -> str:
    """How cold local files were read, for the table: O_DIRECT unless turned off, mapped or preadv."""
    how = "page cache" if os.environ.get("OTFLOAD_DIRECT_IO") == "0" else "O_DIRECT"
    return f"local, cold ({how}, {'mmap' if mmap else 'pread'})"


def measure(ckpt: Path, work: Path, policies: list[str], meshes: dict | None = None,
            sources: tuple[str, ...] = ("local", "hub"), drop_caches: bool = False, mmap: bool = True) -> list[dict]:
    rows = []
    copies = []
    for i in range(PROCESSES):
        copies.append(work / f"copy{i}")
        if not copies[-1].exists():
            shutil.copytree(ckpt, copies[-1])
    os.sync()  # only clean pages can be evicted
    size = harness.tensor_bytes(ckpt)
    with HubServer(work / "hub") as hub:
        repo = hub.add_repo("org/bench-fetch", ckpt)
        for mesh_name, mesh in (meshes or parse_meshes(DEFAULT_MESHES)).items():
            for policy in policies:
                for copy in copies:
                    evict(copy)
                if drop_caches and "local" in sources:
                    drop_page_cache()
                out = work / f"local-{len(rows)}"
                if "local" in sources:
                    job = run({"mesh": mesh, "source": str(work / "copy{i}"), "reshard": policy, "evict": True,
                               "mmap": mmap}, out)  # fmt: skip
                    cluster = sum(r["kernel_read_bytes"] for r in job) / size
                    rows += [{"source": local_kind(mmap), "mesh": mesh_name, "policy": policy, "cluster": cluster, **r}
                             for r in job]  # fmt: skip
                if "warm" in sources:
                    out = work / f"warm-{len(rows)}"
                    job = run({"mesh": mesh, "source": str(work / "copy{i}"), "reshard": policy, "warm": True}, out)
                    rows += [{"source": "local, warm", "mesh": mesh_name, "policy": policy, "cluster": float("nan"),
                              **r} for r in job]  # fmt: skip
                if "hub" not in sources:
                    continue
                if policy == "never":  # a request per row: too slow for the test server, planned instead
                    planned = planned_rows(repo, hub.url, mesh, mesh_name, work)
                    rows += [{**r, "cluster": sum(q["bytes_read"] for q in planned) / size} for r in planned]
                    continue
                hub.reset()
                out = work / f"hub-{len(rows)}"
                results = run({"mesh": mesh, "source": repo, "endpoint": hub.url, "reshard": policy}, out)
                served = hub.body_bytes
                for r in results:
                    rows.append({"source": "Hub", "mesh": mesh_name, "policy": policy, "served_all": served,
                                 "cluster": served / size, **r})  # fmt: skip
                print(f"{mesh_name} {policy}: done", flush=True)
    return rows


def planned_rows(repo: str, endpoint: str, mesh: dict, mesh_name: str, work: Path) -> list[dict]:
    """What each process would fetch reading every leaf in place from the Hub (``reshard="never"``),
    from the plan: the report's fetched bytes equal these (tests/place/test_report.py)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import otfload
    from otfload.read.planned import leaf_planned
    from otfload.read.reader import TensorReader
    from otfload.sources import open_source

    devices = sorted(jax.devices(), key=lambda d: d.id)
    grid = Mesh(np.array(devices).reshape(tuple(mesh.values())), tuple(mesh))
    source = open_source(repo, endpoint=endpoint, cache_dir=str(work / "hf-planned"))
    _, plan, _ = otfload.plan_model(source, mesh=grid)
    reader = TensorReader(source)
    rows = []
    for p in range(PROCESSES):
        mine = devices[p * LOCAL_DEVICES : (p + 1) * LOCAL_DEVICES]
        fetched = [leaf_planned(lp, lp.device_boxes(mine), reader) for lp in plan.leaves.values()]
        rows.append({"source": "Hub (planned)", "mesh": mesh_name, "policy": "never", "process": p,
                     "bytes_read": sum(f[0] for f in fetched), "requests": sum(f[1] for f in fetched),
                     "bytes_ideal": sum(lp.ideal_bytes(mine) for lp in plan.leaves.values()),
                     "resharded": [], "seconds": float("nan")})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    columns = ["source", "mesh", "policy", "process", "fetched (report, MB)", "kernel / server (MB)", "ideal (MB)",
               "fetched / ideal", "all processes / checkpoint", "requests", "leaves resharded", "seconds",
               "reshard s"]  # fmt: skip
    cells = []
    for r in rows:
        if r["source"] == "Hub":
            real = f"{r['served_all'] / 1e6:.1f} (all)" if r["process"] == 0 else ""
        elif "kernel_read_bytes" in r:
            real = f"{r['kernel_read_bytes'] / 1e6:.1f}"
        else:
            real = "—"
        cells.append([r["source"], r["mesh"], r["policy"], r["process"], f"{r['bytes_read'] / 1e6:.1f}", real,
                      f"{r['bytes_ideal'] / 1e6:.1f}", f"{r['bytes_read'] / r['bytes_ideal']:.2f}",
                      f"{r['cluster']:.3f}", r["requests"], len(r["resharded"]), f"{r['seconds']:.1f}",
                      f"{r.get('reshard_seconds', float('nan')):.1f}"])  # fmt: skip
    return harness.table(columns, cells, left=3) + "\n"


def summary(rows: list[dict]) -> str:
    """One line per job, as issue 34's table: the worst process's counted bytes (the kernel's for
    local files, the report's for the Hub, whose server counts all clients together) over its ideal;
    the report's bytes over the counted ones (local: the worst process; Hub: all processes); the route."""
    jobs: dict[tuple[str, str, str], list[dict]] = {}
    for r in rows:
        jobs.setdefault((r["source"], r["mesh"], r["policy"]), []).append(r)
    cells = []
    for (source, mesh, policy), job in jobs.items():
        if source == "local, warm":  # nothing comes from the disk: the report's bytes are page-cache reads
            worst, honest = max(r["bytes_read"] / r["bytes_ideal"] for r in job), "(page cache)"
        elif source == "Hub":
            worst = max(r["bytes_read"] / r["bytes_ideal"] for r in job)
            honest = f"{sum(r['bytes_read'] for r in job) / job[0]['served_all']:.3f}"
        elif "kernel_read_bytes" in job[0]:
            worst = max(r["kernel_read_bytes"] / r["bytes_ideal"] for r in job)
            honest = f"{min(r['bytes_read'] / max(1, r['kernel_read_bytes']) for r in job):.3f}"
        else:
            worst, honest = max(r["bytes_read"] / r["bytes_ideal"] for r in job), "planned"
        seconds = max(r["seconds"] for r in job)
        cells.append([source, mesh, policy, f"{worst:.2f}", honest, f"{seconds:.1f}", job[0].get("route", "")])
    columns = ["source", "mesh", "policy", "counted / ideal (worst process)", "report / counted", "seconds (slowest)",
               "route (process 0)"]  # fmt: skip
    return harness.table(columns, cells, left=3) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.71, help="checkpoint size (0.71 GiB: 766 MB)")
    parser.add_argument("--policies", default="never,auto,always")
    parser.add_argument("--meshes", default=DEFAULT_MESHES, help=f"some of {list(MESHES)}, ',' between meshes, "
                        "':' between one mesh's axes")
    parser.add_argument("--sources", default="local,hub", help="some of local (cold files), warm (local files "
                        "in the page cache), hub")
    parser.add_argument("--pread", action="store_true", help="local files read with preadv (mmap=False)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="also drop the whole page cache before each cold local job (root)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    args = parser.parse_args(argv)
    dims = choose_dims(int(args.size_gib * 2**30))
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        ckpt = work / "ckpt"
        if not (ckpt / "config.json").exists():
            write_checkpoint(ckpt, dims)
        rows = measure(ckpt, work, args.policies.split(","), parse_meshes(args.meshes),
                       tuple(args.sources.split(",")), args.drop_caches, not args.pread)
    size = harness.tensor_bytes(ckpt) if ckpt.exists() else 0
    text = f"Checkpoint: synthetic bf16 Llama, hidden {dims.hidden}, {dims.layers} layers ({size / 1e6:.0f} MB).\n\n"
    text += summary(rows) + "\n" + table(rows)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
