"""Quantized-load benchmark: otfload dequantising FP8 and W4A16 checkpoints on the fly, against its
bf16 load of the same model and each checkpoint's raw read floor.

    python -m benchmarks.bench_quantized --size-gib 0.5 [--repeat 3] [--dir bench_data/llama-0.5g]
        [--methods otfload-bf16,otfload-fp8,...] [--devices 8] [--cold] [--no-breakdown]

One bf16 Llama-shaped checkpoint (``benchmarks.make_checkpoint``; ``--dir`` reuses one) and two copies
of it with every ``*proj.weight`` quantized (``benchmarks.make_quantized``, written next to it as
``<dir>-fp8`` and ``<dir>-w4a16``). Methods, each run in a fresh process on ``--devices`` simulated
CPU devices (the 2×4 mesh of bench_load), interleaved over ``--repeat`` rounds, median reported:

- ``otfload-<variant>``: ``otfload.from_pretrained(dir, mesh=..., dtype="bfloat16")`` — quantized
  weights are dequantised to bf16 per device box;
- ``keep-<variant>`` (quantized variants): the same with ``quantized="keep"`` — the layers' quantized
  kernels placed packed (codes + scales as stored), for the keep vs dequantize device-bytes table;
- ``floor-<variant>``: ``np.fromfile`` of every file of that checkpoint, one thread (the raw read floor).

Each run records wall and CPU seconds, the bytes placed on devices (``LoadReport.bytes_placed``), the
bytes read as otfload counts them (``LoadReport.bytes_read``) and as the kernel does (``/proc/self/io``
``rchar``: read()-family syscalls, which a memory-mapped read does not make; ``read_bytes``: storage
I/O, ~0 on a warm page cache), and the peak RSS (``ru_maxrss`` or a 10 ms sampler, the larger).
Unless ``--cold``, every run first reads its checkpoint once, untimed (as bench_load does).

``--breakdown`` (default) also times the decode alone, one thread, every quantized tensor whole:
reading the parts (page faults of the mapped file), widening the codes, applying the scales, and
the cast to bf16 — in ns per output element, next to a plain bf16 copy.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

from benchmarks import harness

VARIANTS = ("bf16", "fp8", "w4a16", "gptq", "awq")
QUANTIZED = VARIANTS[1:]
DEFAULT_METHODS = ",".join([*(f"{kind}-{v}" for v in VARIANTS for kind in ("floor", "otfload")),
                            *(f"keep-{v}" for v in QUANTIZED)])
GIB = harness.GIB
BF16_BYTES = 2
# What the loader does per quantized tensor, timed one by one in the decode breakdown.
OTFLOAD_STAGES = ("read parts", "widen codes", "apply scales", "cast to bf16")


# --- child: one method, one load, in this process ---------------------------------------------------


def checkpoint_bytes(directory: Path) -> int:
    """Bytes of every file of the checkpoint (shards, index, config)."""
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def plan_figures(plan) -> dict[str, int]:
    """Bytes computed from the load plan (not measured).

    ``stored``: ``LoadPlan.source_bytes`` (codes + scales of quantized weights); ``logical``: every
    leaf once in its target dtype; ``placed``: what the shardings put on all devices (replicated
    leaves count once per copy; equals ``LoadReport.bytes_placed``); ``keep_placed``: the stored
    bytes with each leaf's replication — what a ``quantized="keep"`` load would place.
    ``quantized_*``: the same over the leaves read from quantized tensors only (bf16 for logical).
    """
    from otfload.index.quant import QuantizedTensor

    out = dict.fromkeys(("stored", "logical", "placed", "keep_placed", "quantized_stored", "quantized_logical"), 0)
    for lp in plan.leaves.values():
        leaf = lp.leaf
        logical = math.prod(leaf.shape) * leaf.dtype.itemsize
        placed = math.prod(leaf.sharding.shard_shape(leaf.shape)) * leaf.dtype.itemsize * len(leaf.sharding.device_set)
        out["stored"] += lp.source_bytes
        out["logical"] += logical
        out["placed"] += placed
        out["keep_placed"] += round(lp.source_bytes * placed / logical) if logical else 0
        if lp.sources and isinstance(lp.sources[0], QuantizedTensor):
            out["quantized_stored"] += lp.source_bytes
            out["quantized_logical"] += math.prod(leaf.shape) * BF16_BYTES
    return out


def _prepare(method: str, directory: Path, devices: int):
    """(untimed set-up figures, timed ``run() -> (kept alive, extra figures)``) of ``method``."""
    import numpy as np

    kind = method.split("-", 1)[0]
    if kind == "floor":
        paths = sorted(p for p in directory.iterdir() if p.is_file())

        def run_floor():
            arrays = [np.fromfile(p, np.uint8) for p in paths]
            return arrays, {"placed_bytes": sum(a.nbytes for a in arrays)}

        return {}, run_floor
    if kind not in ("otfload", "keep"):
        raise SystemExit(f"unknown method {method!r}")
    quantized = "keep" if kind == "keep" else "dequantize"
    import otfload
    from benchmarks.target import bench_mesh

    mesh = bench_mesh(devices)
    _, plan, src = otfload.plan_model(directory, mesh=mesh, dtype="bfloat16", quantized=quantized)
    src.close()
    figures = {f"plan_{k}": v for k, v in plan_figures(plan).items()}

    def run_otfload():
        model, report = otfload.from_pretrained(directory, mesh=mesh, dtype="bfloat16", progress=False,
                                                return_report=True, quantized=quantized)
        extra = {"placed_bytes": report.bytes_placed, "report_bytes_read": report.bytes_read,
                 "report_seconds": report.seconds, "requests": report.requests}
        return model, extra

    return figures, run_otfload


def child(method: str, directory: Path, devices: int, cold: bool) -> dict:
    """Run ``method`` once on ``directory`` and measure it (in a fresh process)."""
    import jax

    from benchmarks.target import check_devices

    check_devices(devices)
    figures, run = _prepare(method, directory, devices)
    if not cold:
        harness.warm(directory)
    with harness.measured() as measured:
        loaded, extra = run()
        jax.block_until_ready(jax.tree.leaves(loaded))
    del loaded
    return {"method": method, "directory": str(directory), "checkpoint_bytes": checkpoint_bytes(directory), **measured,
            **figures, **extra}  # fmt: skip


# --- child: the decode alone -----------------------------------------------------------------------


def decode_breakdown(directory: Path, cold: bool = False) -> dict:
    """Time each stage of decoding every quantized tensor of ``directory`` whole, one thread.

    Same calls as the loader (``TensorReader.read_box`` of each part, ``codes.decode``,
    ``scales.apply``) plus the ``astype(bfloat16)`` the builder's copy does; for comparison, a plain
    bf16 copy of an array of the same size and, for FP8 codes, a widening through a 256-entry table.
    """
    import ml_dtypes
    import numpy as np

    from otfload.index.checkpoint import open_index
    from otfload.index.quant import QuantizedTensor
    from otfload.read.arena import Arena
    from otfload.read.reader import TensorReader
    from otfload.sources import open_source

    if not cold:
        harness.warm(directory)
    source = open_source(directory)
    reader, arena = TensorReader(source), Arena()
    stages = dict.fromkeys((*OTFLOAD_STAGES, "bf16 copy (reference)"), 0.0)
    lut = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    elements, lut_seconds = 0, 0.0
    tensors = [t for t in open_index(source).tensors.values() if isinstance(t, QuantizedTensor)]
    for tensor in tensors:
        box = tuple((0, d) for d in tensor.shape)
        t0 = time.perf_counter()
        arrays = {}
        for role, (part, pbox) in tensor.part_boxes(box).items():
            view = reader.read_box(part, pbox, arena)
            arrays[role] = view
            np.add.reduce(view.view(np.uint8).reshape(-1)[:: 4096])  # touch every page: faults counted here
        t1 = time.perf_counter()
        arrays = tensor.oriented(arrays)  # GPTQ / AWQ parts are stored transposed: views swapped back
        values = tensor.codes.decode(arrays, box)
        t2 = time.perf_counter()
        if tensor.scales is not None:
            values = tensor.scales.apply(values, arrays, box)
        t3 = time.perf_counter()
        out = values.astype(ml_dtypes.bfloat16)
        t4 = time.perf_counter()
        out.copy()
        t5 = time.perf_counter()
        if arrays["codes"].dtype == np.dtype(ml_dtypes.float8_e4m3fn):
            lut[arrays["codes"].view(np.uint8)]
            lut_seconds += time.perf_counter() - t5
        for stage, seconds in zip(stages, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            stages[stage] += seconds
        elements += math.prod(tensor.shape)
        arena.reset()
        for part, pbox in tensor.part_boxes(box).values():
            reader.release(part, pbox)
    source.close()
    if lut_seconds:
        stages["widen FP8 via 256-entry table (not otfload; comparison)"] = lut_seconds
    return {"directory": str(directory), "tensors": len(tensors), "elements": elements, "stages": stages}


# --- parent: orchestration --------------------------------------------------------------------------


def _spawn(args: list[str], devices: int) -> dict:
    return harness.run_child("benchmarks.bench_quantized", [*args, "--devices", str(devices)], devices=devices)


def run_child(method: str, directory: Path, devices: int, cold: bool) -> dict:
    if cold:
        harness.drop_caches(directory)
    return _spawn(["--child", method, "--dir", str(directory), *(["--cold"] if cold else [])], devices)


def variant_of(method: str) -> str:
    return method.split("-", 1)[1]


def measure(methods: list[str], dirs: dict[str, Path], devices: int, repeat: int, cold: bool) -> dict[str, dict]:
    """Median figures of each method over ``repeat`` interleaved rounds of fresh processes."""
    runs = harness.rounds(methods, repeat, lambda m: run_child(m, dirs[variant_of(m)], devices, cold))
    return {m: harness.summarize(rs, ("peak_rss", "rss_before", "peak_over_before")) for m, rs in runs.items()}


# --- reporting --------------------------------------------------------------------------------------


def _gib(n: float | None) -> str:
    return "—" if n is None else f"{n / GIB:.3f}"


def results_table(results: dict[str, dict]) -> str:
    columns = ["method", "checkpoint on disk GiB", "seconds (median)", "runs (s)", "CPU s", "output GB/s", "placed GiB",
               "read, LoadReport GiB", "rchar GiB", "read_bytes GiB", "minor faults", "peak RSS GiB",
               "peak − start GiB"]  # fmt: skip
    rows = [
        [method, _gib(r["checkpoint_bytes"]), f"{r['seconds']:.2f}", harness.runs_cell(r["all_seconds"]),
         f"{r['cpu_seconds']:.2f}", f"{r['placed_bytes'] / r['seconds'] / 1e9:.2f}", _gib(r["placed_bytes"]),
         _gib(r.get("report_bytes_read")), _gib(r.get("rchar")), _gib(r["disk_bytes"]), r["minor_faults"],
         f"{r['peak_rss'] / GIB:.2f}", f"{r['peak_over_before'] / GIB:.2f}"]
        for method, r in results.items()
    ]  # fmt: skip
    return harness.table(columns, rows)


def _ratio(num: float | None, den: float | None) -> str:
    return "—" if num is None or not den else f"{num / den:.2f}"


def ratios_table(results: dict[str, dict]) -> str:
    """Each dequantising load against the bf16 load (same run) and against its own floor."""
    base, base_floor = results.get("otfload-bf16"), results.get("floor-bf16")
    present = [v for v in VARIANTS if f"otfload-{v}" in results]
    if not present:
        return "(no otfload method measured: no ratios)"
    rows: list[list[object]] = []

    def row(label: str, cell) -> None:
        rows.append([label, *(cell(v, results[f"otfload-{v}"]) for v in present)])

    row("load time / otfload-bf16 load time", lambda v, r: _ratio(r["seconds"], base and base["seconds"]))
    row("CPU time / otfload-bf16 CPU time", lambda v, r: _ratio(r["cpu_seconds"], base and base["cpu_seconds"]))
    row("output GB/s / otfload-bf16 output GB/s", lambda v, r: _ratio(
        r["placed_bytes"] / r["seconds"], base and base["placed_bytes"] / base["seconds"]))
    bf16_disk = (base or base_floor or {}).get("checkpoint_bytes")
    row("bytes read (LoadReport) / bf16 checkpoint on disk", lambda v, r: _ratio(r.get("report_bytes_read"), bf16_disk))
    row("checkpoint on disk / bf16 checkpoint on disk", lambda v, r: _ratio(r["checkpoint_bytes"], bf16_disk))
    row("quantized weights only: stored / bf16 (computed)", lambda v, r: _ratio(
        r.get("plan_quantized_stored"), r.get("plan_quantized_logical")))
    row("load time / own floor time", lambda v, r: _ratio(r["seconds"], _get(results, f"floor-{v}", "seconds")))
    row("floor time / floor-bf16 time", lambda v, r: _ratio(
        _get(results, f"floor-{v}", "seconds"), base_floor and base_floor["seconds"]))
    row("peak − start / otfload-bf16 peak − start", lambda v, r: _ratio(
        r["peak_over_before"], base and base["peak_over_before"]))
    return harness.table(["figure", *present], rows)


def _get(results: dict[str, dict], method: str, key: str) -> float | None:
    return results[method][key] if method in results else None


def device_bytes_lines(results: dict[str, dict]) -> str:
    """Bytes placed on the devices, measured (``LoadReport.bytes_placed``): ``quantized="keep"`` vs
    ``"dequantize"`` (bf16), with what the plan of the dequantising load estimated for keep."""
    rows = []
    for v in QUANTIZED:
        dense, kept = results.get(f"otfload-{v}"), results.get(f"keep-{v}")
        if dense is None and kept is None:
            continue
        placed = dense and dense["placed_bytes"]
        keep = kept and kept["placed_bytes"]
        rows.append([v, _gib(placed), _gib(keep), _ratio(keep, placed), _gib(dense and dense.get("plan_keep_placed"))])
    columns = ["variant", "dequantize: placed GiB", "keep: placed GiB", "keep / dequantize",
               "keep, estimated from the dequantize plan GiB"]  # fmt: skip
    return "device bytes (all leaves, all devices; measured):\n\n" + harness.table(columns, rows)


def breakdown_table(breakdowns: dict[str, dict]) -> str:
    stages = list(dict.fromkeys(s for b in breakdowns.values() for s in b["stages"]))
    names = list(breakdowns)
    rows: list[list[object]] = []
    for stage in stages:
        cells = []
        for v in names:
            b = breakdowns[v]
            seconds = b["stages"].get(stage)
            cells.append("—" if seconds is None else f"{seconds * 1e9 / b['elements']:.2f}")
        rows.append([stage, *cells])
    totals = []
    for v in names:
        b = breakdowns[v]
        otf = sum(s for k, s in b["stages"].items() if k in OTFLOAD_STAGES)
        totals.append(f"{otf * 1e9 / b['elements']:.2f} ({BF16_BYTES * b['elements'] / otf / 1e9:.2f} GB/s bf16)")
    rows.append(["total of otfload's stages", *totals])
    counts = ", ".join(f"{v}: {b['tensors']} tensors, {b['elements'] / 1e6:.1f} M elements"
                       for v, b in breakdowns.items())
    table = harness.table(["stage (one thread, whole tensors; ns per output element)", *names], rows)
    return f"{table}\n\n({counts})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.5)
    parser.add_argument("--dir", type=Path, default=None,
                        help="the bf16 checkpoint, written first if missing (default: bench_data/llama-<size>g)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--methods", default=None, help=f"comma-separated (default {DEFAULT_METHODS})")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false", help="skip timing the decode alone")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--decode-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.decode_child:
        harness.report(decode_breakdown(args.dir, args.cold))
        return
    if args.child:
        harness.report(child(args.child, args.dir, args.devices, args.cold))
        return
    from benchmarks.make_checkpoint import ensure_checkpoint
    from benchmarks.make_quantized import ensure_quantized

    methods = (args.methods or DEFAULT_METHODS).split(",")
    unknown = [m for m in methods if "-" not in m or m.split("-", 1)[0] not in ("floor", "otfload", "keep")
               or variant_of(m) not in (QUANTIZED if m.startswith("keep-") else VARIANTS)]
    if unknown:
        parser.error(f"unknown methods {unknown} (known: {DEFAULT_METHODS})")
    print(harness.machine_line())
    base = args.dir or ensure_checkpoint(args.size_gib)
    if args.dir is not None and not (base / "config.json").exists():
        ensure_checkpoint(args.size_gib, out=base)
    dirs = {"bf16": base, **{v: ensure_quantized(base, v) for v in QUANTIZED}}
    for v, d in dirs.items():
        print(f"{v:6s} {harness.checkpoint_line(d)}")
    mode = "cold (page cache dropped before each run)" if args.cold else "warm page cache"
    print(f"{args.devices} devices, {mode}, median of {args.repeat} interleaved fresh-process runs\n")
    results = measure(methods, dirs, args.devices, args.repeat, args.cold)
    breakdowns = {}
    if args.breakdown:
        for v in QUANTIZED:
            if args.cold:
                harness.drop_caches(dirs[v])
            cold = ["--cold"] if args.cold else []
            breakdowns[v] = _spawn(["--decode-child", "--dir", str(dirs[v]), *cold], args.devices)
    if args.json:
        args.json.write_text(json.dumps({"results": results, "breakdown": breakdowns}, indent=1))
    print(results_table(results) + "\n\n" + ratios_table(results) + "\n\n" + device_bytes_lines(results))
    if breakdowns:
        print("\ndecode alone:\n\n" + breakdown_table(breakdowns))
    print(harness.machine_line())


if __name__ == "__main__":
    main()
