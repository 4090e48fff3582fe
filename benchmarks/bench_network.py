"""Loading over a shaped network (issue 20 §2): otfload against download-then-load and gcsfs ``cat``.

    python -m benchmarks.bench_network [--size-gib 0.5] [--layouts 128,1000] [--latency-ms 20]
        [--stream-mbps 50] [--link-mbps 300] [--repeat 3] [--out FILE]

The servers run in this process, shaped as a network (``tests/servers/throttle.py``): every request
waits ``--latency-ms`` before its answer, each answer's body is capped at ``--stream-mbps`` (one TCP
stream's share, as a CDN edge or object store serves it) and all bodies together at ``--link-mbps``
(the host's link). Every method runs in a fresh child process (its own peak RSS), its imports and JAX
devices ready before the clock starts; the servers count its requests and file bytes:

* **Hub** (the local Hub-protocol server, tests/servers/hub_server.py): ``otfload.from_pretrained``
  of the repo (range reads straight into the sharded leaves) against
  ``huggingface_hub.snapshot_download`` into an empty local directory followed by
  ``otfload.from_pretrained`` of that copy (download-then-load; the copy is read from the page cache,
  never from a cold disk);
* **gs://** (the real fake-gcs-server behind tests/servers/fault_proxy.py, which shapes and counts):
  ``otfload.from_pretrained("gs://...")`` against gcsfs ``cat`` of every safetensors file (bytes in
  memory only: the floor of moving the same bytes with gcsfs).

Time to first leaf is when the first leaf is placed on its devices (download-then-load: the download
plus its load's first leaf). CPU is the seconds the child, the servers and fake-gcs-server spent, over
the wall time: near the machine's core count, the CPU (not the shaped network) is what limits.
"""

from __future__ import annotations

from benchmarks import harness

harness.simulate_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import psutil  # noqa: E402

from benchmarks.make_checkpoint import Dims, choose_dims, write_checkpoint  # noqa: E402

BUCKET, REPO = "otfload-net", "org/bench-net"
DEVICES = 8  # simulated CPU devices, fsdp=2 x tp=4 (benchmarks/target.py bench_mesh)
# Loaded once in each child before the clock starts (imports, devices, code paths): tiny, so that
# the child's peak RSS is that of the measured load.
WARMUP_DIMS = Dims(hidden=512, intermediate=1408, layers=2, vocab=1024)
CHILD_TIMEOUT_S = 900  # one method, one run: minutes at the slowest shaping this benchmark is run with
HUB_METHODS = ("otfload hub", "download then load")
GS_METHODS = ("gcsfs cat", "otfload gs://")


# --- one method, one run, in a child process -------------------------------------------------------


def child(spec: dict) -> dict:
    """Run ``spec["method"]`` once; seconds to the first leaf and in all, peak RSS."""
    import jax

    import otfload
    import otfload.place.loader as loader
    from benchmarks.target import bench_mesh

    mesh = bench_mesh(DEVICES)
    otfload.from_pretrained(spec["warmup"], mesh=mesh, progress=False)  # imports, devices, code paths
    if "repo" in spec:  # both Hub methods: huggingface_hub's HTTP client (its TLS context: ~0.3 s)
        from huggingface_hub.utils import get_session

        get_session()
    else:  # both gs:// methods
        import gcsfs  # noqa: F401
    first: list[float] = []
    build_leaf = loader.build_leaf

    def timed_build_leaf(*args, **kwargs):
        array = build_leaf(*args, **kwargs)
        if not first:
            jax.block_until_ready(array)
            first.append(time.perf_counter())
        return array

    loader.build_leaf = timed_build_leaf
    method, out = spec["method"], {"rss_before": harness.current_rss()}
    usage_start, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()  # every thread's CPU
    if method == "otfload hub":
        otfload.from_pretrained(spec["repo"], endpoint=spec["endpoint"], cache_dir=spec["cache_dir"], mesh=mesh,
                                progress=False)  # fmt: skip
    elif method == "download then load":
        from huggingface_hub import snapshot_download

        # into a plain directory (``hf download --local-dir``): the HF cache's snapshot is symlinks into
        # blobs/, which a local source refuses to follow out of its directory
        local = snapshot_download(spec["repo"], endpoint=spec["endpoint"], cache_dir=spec["cache_dir"],
                                  local_dir=Path(spec["cache_dir"]) / "local")  # fmt: skip
        out["download_s"] = time.perf_counter() - start
        otfload.from_pretrained(local, mesh=mesh, progress=False)
    elif method == "otfload gs://":
        otfload.from_pretrained(spec["url"], storage_options=spec["storage_options"], mesh=mesh, progress=False)
    elif method == "gcsfs cat":
        from otfload.sources.fsspec_source import open_filesystem

        fs, root = open_filesystem(spec["url"], **spec["storage_options"])
        data = fs.cat([f"{root}/{f}" for f in spec["files"]])
        first.append(time.perf_counter())  # every file at once
        out["bytes_in_memory"] = sum(len(v) for v in data.values())
    else:
        raise ValueError(method)
    end = time.perf_counter()
    usage = resource.getrusage(resource.RUSAGE_SELF)  # CPU split in user and system; fresh pages faulted in
    user, system = usage.ru_utime - usage_start.ru_utime, usage.ru_stime - usage_start.ru_stime
    out.update(total_s=end - start, first_leaf_s=first[0] - start if first else None, peak_rss=harness.peak_rss(),
               client_cpu_s=user + system, client_user_s=user, client_system_s=system,
               minor_faults=usage.ru_minflt - usage_start.ru_minflt)  # fmt: skip
    return out


# --- the servers and the runs -----------------------------------------------------------------------


def shape(faults, args) -> None:
    faults.delay_s = args.latency_ms / 1e3
    faults.rate_bytes_s = args.stream_mbps * 1e6
    faults.link_bytes_s = args.link_mbps * 1e6


def run_child(spec: dict, servers: list[psutil.Process]) -> dict:
    """One run in a fresh process, with the CPU seconds it (measured part only) and the servers spent."""
    before = [p.cpu_times() for p in servers]
    result = harness.run_child("benchmarks.bench_network", ["--child", json.dumps(spec)], devices=DEVICES,
                               timeout=CHILD_TIMEOUT_S, what=spec["method"])  # fmt: skip
    after = [p.cpu_times() for p in servers]
    server_cpu = sum(a.user + a.system - b.user - b.system for a, b in zip(after, before, strict=True))
    result["cpu_s"] = result["client_cpu_s"] + server_cpu  # the servers idle while the child warms up
    return result


def measure_hub(ckpt: Path, work: Path, args) -> list[dict]:
    from tests.servers.hub_server import HubServer

    rows = []
    with HubServer(work / "hub-root") as hub:
        repo = hub.add_repo(REPO, ckpt)
        for name in hub.repo(repo).files():  # the server hashes each file once, for its metadata: not timed
            hub.repo(repo).info(name)
        for method in HUB_METHODS:
            runs = []
            for i in range(args.repeat):
                cache = work / f"hf-cache-{i}"
                hub.reset()
                shape(hub.faults, args)
                spec = {"method": method, "repo": repo, "endpoint": hub.url, "cache_dir": str(cache),
                        "warmup": args.warmup}  # fmt: skip
                result = run_child(spec, [psutil.Process()])
                result.update(requests=len(hub.log), file_gets=len(hub.requests("GET", "/resolve/")),
                              served=hub.body_bytes, connections=hub.connections)  # fmt: skip
                runs.append(result)
                shutil.rmtree(cache, ignore_errors=True)
                print(f"hub {method} run {i}: {result}", flush=True)
            rows.append({"store": "Hub", "method": method, **summarize(runs)})
    return rows


def measure_gs(ckpt: Path, files: list[str], args) -> list[dict]:
    from tests.servers.fault_proxy import FaultProxy
    from tests.servers.gcs_server import GcsServer

    rows = []
    with GcsServer() as gcs, FaultProxy(gcs.url) as proxy:
        url = gcs.upload_dir(ckpt, BUCKET, "llama")
        options = {"endpoint_url": proxy.url, "token": "anon"}
        servers = [psutil.Process(), psutil.Process(gcs._proc.pid)]
        for method in GS_METHODS:
            runs = []
            for i in range(args.repeat):
                proxy.reset()
                shape(proxy.faults, args)
                spec = {"method": method, "url": url, "storage_options": options, "files": files,
                        "warmup": args.warmup}  # fmt: skip
                result = run_child(spec, servers)
                result.update(requests=len(proxy.log), file_gets=len(proxy.requests("alt=media")),
                              served=proxy.body_bytes)  # fmt: skip
                runs.append(result)
                print(f"gs {method} run {i}: {result}", flush=True)
            rows.append({"store": "gs://", "method": method, **summarize(runs)})
    return rows


def summarize(runs: list[dict]) -> dict:
    """The median run by total time, every figure its own (an odd number of runs: the median total)."""
    return {**sorted(runs, key=lambda r: r["total_s"])[len(runs) // 2], "runs": len(runs)}


# --- the report -----------------------------------------------------------------------------------------


def table(rows: list[dict], tensor_bytes: int) -> list[str]:
    columns = ["store", "method", "first leaf (s)", "total (s)", "GB/s", "requests (file GETs)", "MB served",
               "CPU s: client + servers", "CPU / wall", "peak RSS GiB (before)"]  # fmt: skip
    cells = []
    for r in rows:
        first = f"{r['first_leaf_s']:.2f}" if r["first_leaf_s"] is not None else "—"
        if r["method"] == "download then load":
            first += f" (download {r['download_s']:.2f})"
        cells.append([r["store"], r["method"], first, f"{r['total_s']:.2f}", f"{tensor_bytes / r['total_s'] / 1e9:.3f}",
                      f"{r['requests']} ({r['file_gets']})", f"{r['served'] / 1e6:.1f}",
                      f"{r['client_cpu_s']:.2f} + {r['cpu_s'] - r['client_cpu_s']:.2f}",
                      f"{r['cpu_s'] / r['total_s']:.2f}",
                      f"{r['peak_rss'] / harness.GIB:.2f} ({r['rss_before'] / harness.GIB:.2f})"])  # fmt: skip
    return harness.table(columns, cells, left=2).splitlines()


def ratios(rows: list[dict]) -> list[str]:
    by = {(r["store"], r["method"]): r for r in rows}
    out = []
    hub, dl = by.get(("Hub", "otfload hub")), by.get(("Hub", "download then load"))
    if hub and dl:
        out.append(f"Hub: otfload is **{dl['total_s'] / hub['total_s']:.2f}×** download-then-load in total time "
                   f"(target ≥ 1.5×), {dl['first_leaf_s'] / hub['first_leaf_s']:.1f}× to the first leaf.")  # fmt: skip
    gs, cat = by.get(("gs://", "otfload gs://")), by.get(("gs://", "gcsfs cat"))
    if gs and cat:
        out.append(f"gs://: otfload's throughput is **{cat['total_s'] / gs['total_s']:.2f}×** gcsfs `cat`'s "
                   "(target ≥ 0.9×), end to end against bytes in memory.")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--layouts", default="128,1000", help="shard sizes in MB, one checkpoint layout each")
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--stream-mbps", type=float, default=50.0, help="cap per answer, MB/s (0: none)")
    parser.add_argument("--link-mbps", type=float, default=300.0, help="cap on all answers together, MB/s (0: none)")
    parser.add_argument("--stores", default="hub,gs")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="append the markdown section to this file")
    args = parser.parse_args(argv)
    if args.child:
        harness.report(child(json.loads(args.child)))
        return
    dims = choose_dims(int(args.size_gib * 2**30))
    command = " ".join(["python -m benchmarks.bench_network", *(argv if argv is not None else sys.argv[1:])])
    text = [
        f"Command: `{command}`",
        "",
        f"Shaping: {args.latency_ms:g} ms per request, {args.stream_mbps:g} MB/s per answer, {args.link_mbps:g} MB/s "
        f"for all answers together; {DEVICES} CPU devices (fsdp=2, tp=4); {os.cpu_count()} vCPUs shared by "
        f"client and servers; the median of {args.repeat} runs (by total time), each in a fresh process.",
    ]
    stores = args.stores.split(",")
    for shard_mb in (int(s) for s in args.layouts.split(",")):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            ckpt = write_checkpoint(work / "ckpt", dims, shard_bytes=shard_mb * 10**6)
            args.warmup = str(write_checkpoint(work / "warmup", WARMUP_DIMS))
            files = sorted(p.name for p in ckpt.glob("*.safetensors"))
            tensor_bytes = sum((ckpt / f).stat().st_size for f in files)
            rows = (measure_hub(ckpt, work, args) if "hub" in stores else []) + (
                measure_gs(ckpt, files, args) if "gs" in stores else []
            )
        text += [
            "",
            f"#### {len(files)} file(s) of ≤ {shard_mb} MB: Llama hidden {dims.hidden}, {dims.layers} layers, bf16, "
            f"{tensor_bytes / 1e6:.0f} MB",
            "",
            *table(rows, tensor_bytes),
            "",
            *ratios(rows),
        ]
    report = "\n".join(text) + "\n"
    print(report)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + report)


if __name__ == "__main__":
    main()
