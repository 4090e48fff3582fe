"""Where one otfload load spends its time: py-spy samples every thread of a fresh load process.

    python -m benchmarks.profile_load [--size-gib 1.0] [--moe] [--method otfload] [--top 20] [--cold]

Prints the functions with the most samples, inclusive (the function or anything it calls) and
self (the innermost Python frame; time in C — memcpy, page faults, XLA — counts for the Python
function that called it), as a share of the samples taken during the load. The raw collapsed
stacks are kept (``--raw``) for a flame graph.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks import harness
from benchmarks.make_checkpoint import ensure_checkpoint

# Stacks of the load itself: a frame in otfload or the baselines, not the benchmark's own planning.
_LOAD_FRAME = re.compile(r"\((?:.*/)?(?:otfload|benchmarks/baselines)")
_SKIP_FRAME = re.compile(r"open_target|_find_and_load")
_LINE = re.compile(r":\d+\)$")


def _function(frame: str) -> str:
    """``build_box (otfload/place/builder.py:45)`` → ``build_box (otfload/place/builder.py)``."""
    name = _LINE.sub(")", frame)
    return re.sub(r"\(.*?site-packages/", "(", name)


def summarize(raw: str, top: int) -> str:
    """Top functions by inclusive and by self samples among the load's stacks."""
    inclusive, own, total = Counter(), Counter(), 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not count.isdigit() or not any(_LOAD_FRAME.search(f) for f in frames):
            continue
        if any(_SKIP_FRAME.search(f) for f in frames):
            continue
        n = int(count)
        total += n
        for name in {_function(f) for f in frames if not f.startswith(("thread ", "process "))}:
            inclusive[name] += n
        own[_function(frames[-1])] += n
    if not total:
        return "no samples of the load"
    def top_rows(counts: Counter) -> list[list[object]]:
        return [[f"{100 * n / total:.1f}", f"`{name}`"] for name, n in counts.most_common(top)]

    return "\n\n".join([f"{total} samples during the load (all threads)",
                         harness.table(["inclusive %", "function"], top_rows(inclusive), left=0),
                         harness.table(["self %", "function"], top_rows(own), left=0)])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--method", default="otfload")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--raw", type=Path, default=Path("/tmp/otfload_profile.txt"))
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: bench_data/...)")
    parser.add_argument("--cold", action="store_true", help="drop the page cache first (see bench_load --cold)")
    args = parser.parse_args(argv)
    directory = args.dir or ensure_checkpoint(args.size_gib, args.moe)
    if args.cold:
        print(f"cold: {harness.drop_caches(directory)}")
    py_spy = Path(sys.executable).with_name("py-spy")
    cmd = [str(py_spy), "record", "--format", "raw", "--threads", "--rate", str(args.rate), "-o", str(args.raw)]
    load = [sys.executable, "-m", "benchmarks.bench_load", "--child", args.method, "--dir", str(directory)]
    load += ["--cold"] if args.cold else []
    subprocess.run([*cmd, "--", *load, "--devices", str(args.devices)], env=harness.child_env(args.devices), check=True)
    print(f"{args.method} on {directory}, {args.devices} devices, {harness.load_line()}")
    print(summarize(args.raw.read_text(), args.top))


if __name__ == "__main__":
    main()
