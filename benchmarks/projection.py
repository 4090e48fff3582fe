"""Projected load time of real checkpoints on real clusters (issue 17 §3) — a projection, not a measurement.

    for m in deepseek-v3 llama-3.1-405b qwen3-235b-a22b gpt-oss-120b; do
      python scripts/make_replica.py $m /tmp/replicas/$m
    done
    python -m benchmarks.projection --replicas /tmp/replicas [--store-gbps 100] [--cache FILE.json]

What is *measured* here: the bytes and requests one process fetches (what ``otfload inspect
--process-index 0 --process-count P`` computes on the sparse replicas: the real headers, the planner and
reader that run in a load, the read layouts the reshard time model picks for the platform and the
source — local pages for a copy on each node's disk, merged byte ranges for a remote store), the read
efficiency of a load against the raw read floor on this machine and the plan times.
What is *published* (the constants below, with their sources): the hosts' links. What is *assumed*: that
a load runs at the measured efficiency of the link that bounds it, that the store serves
``--store-gbps`` in aggregate, and that each new reshard program compiles in RESHARD_COMPILE_S.

    load ≈ plan + max(bytes per host / (EFFICIENCY × host link) + requests × seconds per request,
                      bytes of all hosts / store)
           + reshard (compiles + bytes moved per device / interconnect per device)

Requests cost what the time model charges them (LOCAL_REQUEST_S, REMOTE_REQUEST_S: 16 in flight); a
remote band is counted as one request per contiguous run, not per 8 MiB chunk (chunks overlap).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from otfload.place.collective_route import LOCAL_REQUEST_S, REMOTE_REQUEST_S, RESHARD_COMPILE_S

MODELS = ("llama-3.1-405b", "deepseek-v3", "qwen3-235b-a22b", "gpt-oss-120b")
# Plan time, scan_layers=True, measured on the replicas (docs/benchmarks.md, "Plans at real size"; 2026-11-26).
PLAN_SECONDS = {"deepseek-v3": 3.49, "llama-3.1-405b": 0.22, "qwen3-235b-a22b": 1.06, "gpt-oss-120b": 0.11}
# A load reaches 0.80-1.11 x the raw read floor of local files and 0.98 x gcsfs' whole-file reads
# (docs/benchmarks.md "Targets", docs/benchmarks_remote.md): the lowest of these.
EFFICIENCY = 0.8


@dataclass(frozen=True)
class Cluster:
    """One cluster: hosts (one JAX process each), devices, and the links a load crosses."""

    name: str
    key: str  # the inspect files' tag
    hosts: int
    devices: int
    host_link: float  # bytes/s one host reads the checkpoint at
    interconnect: float  # bytes/s one device receives a reshard at (one direction)
    source: str
    mesh: str
    platform: str
    files: bool  # read as files (page cache, preadv) rather than by HTTP range requests
    shared: bool  # one store serves every host (its aggregate bandwidth bounds the load)


CLUSTERS = (
    # Cloud TPU v5p documentation: v5p-256 (4x4x8) = 128 chips on 32 hosts of 4; data center network
    # 50 Gb/s per chip (200 Gb/s = 25 GB/s per host); inter-chip interconnect 1,200 GB/s per chip,
    # bidirectional (600 GB/s one way). The checkpoint is read from a bucket (no large local disk).
    Cluster("TPU v5p-256", "v5p", 32, 128, 25e9, 600e9, "bucket over DCN", "fsdp=16,tp=8", "tpu", False, True),
    # NVIDIA DGX H100 datasheet: 8 H100 SXM per node; 8 x 3.84 TB U.2 NVMe; 2 dual-port ConnectX-7
    # (up to 400 Gb/s) for storage; 8 x 400 Gb/s ConnectX-7 for the compute fabric (one per GPU:
    # 50 GB/s per GPU across nodes, NVLink 450 GB/s one way inside a node). Local NVMe: 26.4 GB/s, the
    # NVMe read fastsafetensors measured on one node with GPUDirect Storage (IEEE CLOUD 2025).
    Cluster("32 x H100 (4 nodes x 8)", "h100", 4, 32, 26.4e9, 50e9, "a copy on each node's NVMe", "fsdp=4,tp=8",
            "gpu", True, False),
    # A parallel file system (NFS, Lustre, 3FS, ...) mounted on every node, read through the storage NICs.
    Cluster("32 x H100 (4 nodes x 8)", "h100", 4, 32, 100e9, 50e9, "shared file system, 2 x 400 Gb/s per node",
            "fsdp=4,tp=8", "gpu", True, True),
)


class Remote:
    """A source seen as a remote store: it neither maps nor pages (ranges, merged as remote)."""

    mapped, page_granular = None, False

    def __init__(self, source: Any):
        self.source = source

    def __getattr__(self, name: str) -> Any:
        return getattr(self.source, name)


def child_totals(replica: str, mesh: str, hosts: int, platform: str, policy: str, files: bool) -> dict:
    """Process 0 of ``hosts`` on ``mesh`` (this process's simulated devices), planned as ``otfload
    inspect --process-index 0`` does: its totals."""
    from otfload.api import plan_model
    from otfload.cli.inspect import describe_plan
    from otfload.cli.options import mesh_arg
    from otfload.plan.sharding import make_mesh
    from otfload.read.reader import TensorReader

    _, plan, src = plan_model(replica, mesh=make_mesh(mesh_arg(mesh)))
    source = src if files else Remote(src)
    info = describe_plan(plan, src.description, None, "", None, reader=TensorReader(source), process=(0, hosts),
                         reshard=policy, platform=platform)  # fmt: skip
    totals: dict = info["totals"]
    return totals


def totals(replica: Path, cluster: Cluster, policy: str) -> dict:
    """Process 0's totals (bytes, requests, leaves resharded) of ``replica`` on ``cluster``, planned in a
    fresh process on the cluster's device count."""
    args = ["--child", str(replica), cluster.mesh, str(cluster.hosts), cluster.platform, policy,
            "local" if cluster.files else "remote"]  # fmt: skip
    return harness.run_child("benchmarks.projection", args, devices=cluster.devices, what=f"planning {replica}")


def project(t: dict, model: str, cluster: Cluster, store: float) -> dict:
    """Seconds of each term for process 0's totals ``t`` (the processes of these meshes fetch alike)."""
    per_host = t["fetch_bytes"]
    all_hosts = per_host * cluster.hosts
    request_s = t["requests"] * (LOCAL_REQUEST_S if cluster.files else REMOTE_REQUEST_S)
    host_s = per_host / (EFFICIENCY * cluster.host_link) + request_s
    store_s = all_hosts / store if cluster.shared else 0.0
    moved = t["device_bytes"] if t["resharded_leaves"] else 0  # at most every byte a device holds
    reshard_s = t["resharded_leaves"] * RESHARD_COMPILE_S + moved / cluster.interconnect
    total = PLAN_SECONDS[model] + max(host_s, store_s) + reshard_s
    return {"per_host": per_host, "all_hosts": all_hosts, "requests": t["requests"], "host_s": host_s,
            "store_s": store_s, "reshard_s": reshard_s, "total": total}  # fmt: skip


def seconds(s: float) -> str:
    return "> 1 h" if s > 3600 else f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


def table(replicas: Path, store: float, cache: Path | None = None) -> str:
    rows = []
    known = json.loads(cache.read_text()) if cache and cache.exists() else {}
    for cluster in CLUSTERS:
        for model in MODELS:
            for policy in ("auto", "never"):
                key = f"{model}.{cluster.key}.{'local' if cluster.files else 'remote'}.{policy}"
                if key not in known:
                    known[key] = totals(replicas / model, cluster, policy)
                    if cache:
                        cache.write_text(json.dumps(known, indent=1))
                t = known[key]
                p = project(t, model, cluster, store)
                store_s = seconds(p["store_s"]) if cluster.shared else "—"
                rows.append([cluster.name, cluster.source, model, f"{t['source_bytes'] / 1e9:.0f} GB", policy,
                             f"{p['per_host'] / 1e9:.1f} GB", f"{p['requests']:,}",
                             f"{p['all_hosts'] / t['source_bytes']:.2f}", seconds(p["host_s"]), store_s,
                             seconds(p["reshard_s"]), f"**{seconds(p['total'])}**"])  # fmt: skip
    columns = ["cluster", "source", "model", "checkpoint", "policy", "per host", "requests per host",
               "all hosts / checkpoint", "host-bound", "store-bound", "reshard", "**load**"]  # fmt: skip
    return harness.table(columns, rows, left=3) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=Path, help="one replica per model (scripts/make_replica.py; required)")
    parser.add_argument("--cache", type=Path, default=None, help="keep each plan's totals here (JSON), reuse them")
    parser.add_argument("--store-gbps", type=float, default=100.0,
                        help="GB/s the shared store serves all hosts together (an assumption; default 100)")
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        replica, mesh, hosts, platform, policy, kind = args.child
        harness.report(child_totals(replica, mesh, int(hosts), platform, policy, kind == "local"))
        return
    if args.replicas is None:
        parser.error("--replicas is required")
    print(table(args.replicas, args.store_gbps * 1e9, args.cache))


if __name__ == "__main__":
    main()
