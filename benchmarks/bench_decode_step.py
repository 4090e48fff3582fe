"""Wall and CPU time of one decoding step of ``otfload.generate`` on a small model: what a step
costs beyond its arithmetic (dispatch, the program look-up, reading the token back).

    python -m benchmarks.bench_decode_step              # one CPU device, then 8 on an fsdp=2,tp=4 mesh
    python -m benchmarks.bench_decode_step --preset small --steps 128

The checkpoint is ``benchmarks.bench_eval``'s preset (``tiny`` by default: 13 M parameters); the
prompt a batch of 4 rows of 8 tokens. A step's time is the difference between a generation of
``--steps + 2`` new tokens and one of 2, divided by ``--steps`` (the prefill, the first decode step
and the result's transfer cancel out): median (and the wall's minimum) over ``--repeats`` pairs
after a warm-up that compiles both lengths. Beside the wall, the process's CPU seconds (every
thread, user + system), steadier than the wall on a shared machine. Two ways of running: ``read``
with a ``stop`` callback that reads every step's tokens back, as lm_eval's ``generate_until``
does, and ``free`` with no EOS ids and no callback, so steps queue up as far as
``otfload.generate`` lets them. Each device layout runs in a child process (``XLA_FLAGS`` is read
when JAX starts).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from benchmarks import harness
from benchmarks.bench_eval import PRESETS, build

CHILD = """
import json, os, resource, sys, time, warnings
import numpy as np
import otfload
from otfload.plan.sharding import make_mesh
warnings.simplefilter("ignore")  # a long generation of a small-context model warns past its positions
ckpt, devices, steps, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
mesh = make_mesh({"fsdp": 2, "tp": 4}) if devices == 8 else None
model = otfload.from_pretrained(ckpt, mesh=mesh, dtype="float32")
ids = np.arange(1, 33, dtype=np.int32).reshape(4, 8)
out = {}
for mode, stop in (("read", lambda new: False), ("free", None)):
    def seconds(n):  # (wall, CPU of every thread: user + system)
        usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        otfload.generate(model, ids, n, eos_token_id=[], stop=stop)
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
        return np.array([wall, after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime])
    seconds(2), seconds(steps + 2)  # compiled
    per_step = np.array([(seconds(steps + 2) - seconds(2)) / steps for _ in range(repeats)])
    out[mode] = np.median(per_step, axis=0).tolist() + [float(per_step[:, 0].min())]
print(json.dumps(out))
"""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="the checkpoint (bench_eval's)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per generation (default: 64)")
    parser.add_argument("--repeats", type=int, default=7, help="pairs of generations timed (default: 7)")
    args = parser.parse_args(argv)
    ckpt, _ = build(args.preset, texts=1, length=16)
    rows = []
    for devices in (1, 8):
        flags = f"--xla_force_host_platform_device_count={devices}"
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
        out = subprocess.run([sys.executable, "-c", CHILD, str(ckpt.resolve()), str(devices), str(args.steps),
                              str(args.repeats)], capture_output=True, text=True, env=env, check=False)
        if out.returncode:
            sys.exit(f"the {devices}-device child failed:\n{out.stderr[-4000:]}")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        layout = "one device" if devices == 1 else "fsdp=2,tp=4 over 8 host devices"
        rows += [[layout, mode, f"{wall * 1e3:.2f}", f"{best * 1e3:.2f}", f"{cpu * 1e3:.2f}"]
                 for mode, (wall, cpu, best) in result.items()]
    print(f"load average {os.getloadavg()[0]:.2f}; {args.preset}, batch 4, {args.steps} steps, {args.repeats} repeats")
    print(harness.table(["layout", "tokens", "wall ms per step (median)", "wall ms (min)", "CPU ms per step (median)"],
                        rows, left=2))


if __name__ == "__main__":
    main()
