"""Plans at real size: plan time, peak RSS and bytes per process on sparse replicas (issue 17 §3).

    python scripts/make_replica.py deepseek-v3 /tmp/replicas/deepseek-v3   # and the other models
    python -m benchmarks.bench_plan --replicas /tmp/replicas [--devices 256] [--mesh fsdp=32,tp=8] \
        [--repeat 3] [--json /tmp/plan.json] [--plot docs/plan_scale.png]

Each (model, scan_layers) runs in a fresh process with ``--devices`` simulated CPU devices:
``otfload.plan_model`` is timed (headers, config, abstract model, plan; JAX start-up excluded) and the
process's peak RSS taken after it; then the plan of process 0 of ``--processes`` is described as
``otfload inspect --process-index 0 --process-count P`` does (bytes it needs, fetches and ideally holds,
in the layouts the reshard time model picks for ``--platform``, local files). With ``--repeat N`` each
row runs N times and keeps the fastest plan (on a shared machine the others measure the other jobs;
the bytes do not change). ``--json`` keeps every row's figures (and the parameters each plan places);
``--plot`` draws them against model size (``benchmarks/plot_plan.py``, matplotlib from the ``bench``
extra).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path

from benchmarks import harness

MODELS = ("deepseek-v3", "llama-3.1-405b", "qwen3-235b-a22b", "gpt-oss-120b")


def plan_row(path: str | Path, scan: bool, mesh: str, processes: int, platform: str) -> dict:
    """Plan ``path`` on ``mesh`` (of this process's JAX devices) and describe process 0 of ``processes``:
    plan time (wall, and CPU of all threads: less sensitive to other jobs) and peak RSS, parameters
    placed, the bytes it needs, fetches and ideally holds."""
    import math
    import time

    from otfload.api import plan_model
    from otfload.cli.inspect import describe_plan
    from otfload.cli.options import mesh_arg
    from otfload.plan.sharding import make_mesh
    from otfload.read.reader import TensorReader

    device_mesh = make_mesh(mesh_arg(mesh))
    start, cpu = time.perf_counter(), time.process_time()
    _, plan, src = plan_model(path, mesh=device_mesh, scan_layers=scan)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    rss = harness.peak_rss()
    start = time.perf_counter()
    try:
        info = describe_plan(plan, src.description, None, "", None, reader=TensorReader(src), process=(0, processes),
                             platform=platform)  # fmt: skip
    finally:
        src.close()
    t = info["totals"]
    return {"plan_s": seconds, "plan_cpu_s": cpu, "peak_rss": rss, "leaves": t["leaves"],
            "source_bytes": t["source_bytes"],
            "parameters": sum(math.prod(p.leaf.shape) for p in plan.leaves.values()),
            "needed": t["process_bytes"], "fetched": t["fetch_bytes"], "ideal": t["ideal_bytes"],
            "requests": t["requests"], "resharded": t["resharded_leaves"],
            "describe_s": time.perf_counter() - start,
            "peak_rss_after": harness.peak_rss()}  # fmt: skip


def measure(path: Path, scan: bool, devices: int, mesh: str, processes: int, platform: str) -> dict:
    """One (model, scan_layers) row, planned in a fresh process: its peak RSS is the planning's, and the
    simulated device count is set before JAX starts."""
    args = ["--child", str(Path(path).resolve()), "--devices", str(devices), "--mesh", mesh, "--processes",
            str(processes), "--platform", platform, *([] if scan else ["--unscanned"])]  # fmt: skip
    return harness.run_child("benchmarks.bench_plan", args, devices=devices, what=f"planning {path} (scan={scan})")


def tensor_count(path: Path) -> int | None:
    """Tensors in a sharded checkpoint's index (what planning walks: the plan time follows it)."""
    index = path / "model.safetensors.index.json"
    return len(json.loads(index.read_text())["weight_map"]) if index.exists() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=Path, help="directory with one replica per model (required)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--devices", type=int, default=256)
    parser.add_argument("--mesh", default="fsdp=32,tp=8")
    parser.add_argument("--processes", type=int, default=32, help="processes sharing the devices (8 each)")
    parser.add_argument("--platform", default="tpu", help="target platform of the reshard time model")
    parser.add_argument("--repeat", type=int, default=1, help="fresh processes per row; the fastest plan is kept")
    parser.add_argument("--json", type=Path, default=None, help="also write every row's figures here")
    parser.add_argument("--plot", type=Path, default=None, help="draw them against model size (PNG)")
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--unscanned", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.report(plan_row(args.child, not args.unscanned, args.mesh, args.processes, args.platform))
        return
    if args.replicas is None:
        parser.error("--replicas is required")
    started = f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {os.cpu_count()} CPUs, {harness.load_line()}"
    print(started)
    print(harness.table(["model", "scan_layers", "leaves", "plan s", "plan CPU s", "peak RSS (MiB)",
                         "process 0 needs (GiB)", "fetches (GiB)", "ideal (GiB)", "fetched / ideal", "requests",
                         "leaves resharded"], [], left=2))  # fmt: skip
    rows = []
    for model in args.models.split(","):
        for scan in (True, False):
            runs = [measure(args.replicas / model, scan, args.devices, args.mesh, args.processes, args.platform)
                    for _ in range(args.repeat)]  # fmt: skip
            r = min(runs, key=lambda run: run["plan_s"])  # the least disturbed by other jobs on the machine
            r["plan_s_runs"] = [run["plan_s"] for run in runs]
            rows.append({"model": model, "scan_layers": scan, "tensors": tensor_count(args.replicas / model), **r})
            print(harness.row([model, scan, r["leaves"], f"{r['plan_s']:.2f}", f"{r['plan_cpu_s']:.2f}",
                               f"{r['peak_rss'] / 2**20:.0f}", f"{r['needed'] / 2**30:.1f}",
                               f"{r['fetched'] / 2**30:.1f}", f"{r['ideal'] / 2**30:.1f}",
                               f"{r['fetched'] / r['ideal']:.2f}", r["requests"], r["resharded"]]), flush=True)
    after = harness.load_line()
    print(f"after: {after}")
    results = {"devices": args.devices, "mesh": args.mesh, "processes": args.processes, "platform": args.platform,
               "repeat": args.repeat, "machine": started, "machine_after": after,
               "rows": rows}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        from benchmarks.plot_plan import plot

        print(f"plot: {plot(results, args.plot)}")


if __name__ == "__main__":
    main()
