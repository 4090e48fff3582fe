"""Plans at real size: plan time, peak RSS and bytes per process on sparse replicas (issue 17 §3).

    python scripts/make_replica.py deepseek-v3 /tmp/replicas/deepseek-v3   # and the other models
    python -m benchmarks.bench_plan --replicas /tmp/replicas [--devices 256] [--mesh fsdp=32,tp=8]

Each (model, scan_layers) runs in a fresh process with ``--devices`` simulated CPU devices:
``otfload.plan_model`` is timed (headers, config, abstract model, plan; JAX start-up excluded) and the
process's peak RSS taken after it; then the plan of process 0 of ``--processes`` is described as
``otfload inspect --process-index 0 --process-count P`` does (bytes it needs, fetches and ideally holds,
in the layouts the reshard cost model picks for ``--platform``, local files).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MODELS = ("deepseek-v3", "llama-3.1-405b", "qwen3-235b-a22b", "gpt-oss-120b")

CHILD = r"""
import json, os, resource, sys, time
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[3]}"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax
from otfload.api import plan_model
from otfload.cli.inspect import describe_plan
from otfload.cli.options import mesh_arg
from otfload.plan.sharding import make_mesh
from otfload.read.reader import TensorReader
mesh = make_mesh(mesh_arg(sys.argv[4]))
start = time.perf_counter()
_, plan, src = plan_model(sys.argv[1], mesh=mesh, scan_layers=sys.argv[2] == "1")
seconds = time.perf_counter() - start
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
start = time.perf_counter()
info = describe_plan(plan, src.description, None, "", None, reader=TensorReader(src), process=(0, int(sys.argv[5])),
                     platform=sys.argv[6])
t = info["totals"]
print(json.dumps({"plan_s": seconds, "peak_rss": rss, "leaves": t["leaves"], "source_bytes": t["source_bytes"],
                  "needed": t["process_bytes"], "fetched": t["fetch_bytes"], "ideal": t["ideal_bytes"],
                  "requests": t["requests"], "resharded": t["resharded_leaves"],
                  "describe_s": time.perf_counter() - start,
                  "peak_rss_after": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def measure(path: Path, scan: bool, devices: int, mesh: str, processes: int, platform: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), "1" if scan else "0", str(devices), mesh,
                          str(processes), platform], capture_output=True, text=True, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=Path, required=True, help="directory with one replica per model")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--devices", type=int, default=256)
    parser.add_argument("--mesh", default="fsdp=32,tp=8")
    parser.add_argument("--processes", type=int, default=32, help="processes sharing the devices (8 each)")
    parser.add_argument("--platform", default="tpu", help="target platform of the reshard cost model")
    args = parser.parse_args(argv)
    print("| model | scan_layers | leaves | plan s | peak RSS (MiB) | process 0 needs (GiB) | fetches (GiB) | "
          "ideal (GiB) | fetched / ideal | requests | leaves resharded |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        for scan in (True, False):
            r = measure(args.replicas / model, scan, args.devices, args.mesh, args.processes, args.platform)
            print(f"| {model} | {scan} | {r['leaves']} | {r['plan_s']:.2f} | {r['peak_rss'] / 2**20:.0f} | "
                  f"{r['needed'] / 2**30:.1f} | {r['fetched'] / 2**30:.1f} | {r['ideal'] / 2**30:.1f} | "
                  f"{r['fetched'] / r['ideal']:.2f} | {r['requests']} | {r['resharded']} |", flush=True)


if __name__ == "__main__":
    main()
