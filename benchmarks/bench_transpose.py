"""Transposed (``[in, out]``) loads against contiguous ones, and against a tunix-style loader.

    python -m benchmarks.bench_transpose --size-gib 1.0 --repeat 3 [--methods ...] [--devices 8]
    python -m benchmarks.bench_transpose --kernel          # the copy kernel alone, on one matrix

The checkpoint is ``benchmarks.make_checkpoint``'s Llama-shaped bf16 one. Every method loads the
same weights onto the same devices (mesh ``fsdp × tp``, 8 simulated CPU devices by default) in a
fresh process, warm page cache, interleaved rounds, medians:

* ``contiguous`` — ``otfload.load_params`` into the MaxText-style tree with every projection kept
  ``[out, in]`` (HF's orientation: hooks are reshapes, the copy is contiguous);
* ``transposed`` — the same with ``[in, out]`` kernels: ``otfload.mappings.maxtext_llama``'s
  table, ``Transpose`` on every projection (the builder's tiled copy, :mod:`otfload.place.transpose`);
* ``tiled`` — ``transposed`` with numpy's tiled copy instead of XLA's host transpose
  (:data:`otfload.place.transpose.XLA_TRANSPOSE` off: the kernel of 2026-11-24);
* ``untiled`` — ``transposed`` with the tiled copy switched off too (one ``np.copyto`` per slice);
* ``numpy_alloc`` — ``contiguous`` with every shard buffer from ``np.empty`` (which asks for
  transparent huge pages from 4 MiB) instead of populated 4 KiB mappings
  (:data:`otfload.read.arena.OWN_MAPPING_BYTES`): the allocation before 2026-11-25;
* ``transposed_unscanned`` — ``transposed`` with one leaf per layer (what tunix's models hold);
* ``tunix_style`` — a re-implementation of tunix 0.1.7's ``load_and_create_model_opt`` on that
  unscanned tree: every file ``mmap``-ed and viewed with ``np.frombuffer``, each HF tensor a view,
  transposed and reshaped as views, then ``jax.device_put(view, sharding)`` per leaf (XLA's strided
  copy per device shard). tunix itself is not installed: ``pip install google-tunix`` pulls ~50
  packages (TensorFlow Datasets, pyarrow, numba, ...) and downgrades transformers.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import mmap
import os
import statistics
import struct
import sys
import time
from pathlib import Path

from benchmarks import harness

METHODS = ("contiguous", "numpy_alloc", "transposed", "tiled", "untiled", "transposed_unscanned", "tunix_style")
GIB = 2**30
KERNEL_SHAPE = (2048, 5632)  # a 22 MiB bf16 matrix, the example


# --- the trees -------------------------------------------------------------------------------------


def contiguous_target(config: dict, mesh, dtype) -> tuple[dict, object]:
    """The MaxText-style tree with every projection ``[out, in]``, and its table (no transpose)."""
    import jax
    import numpy as np

    from otfload.mappings import maxtext_llama as mt
    from otfload.plan.hooks import Reshape
    from otfload.plan.mapping import MappingTable, Rule
    from otfload.plan.sharding import logical_to_sharding

    swapped = {  # leaf → (axis order of the [in, out] leaf to take, hooks from HF)
        "self_attention.query.kernel": ((0, 2, 3, 1), (Reshape(("num_attention_heads", -1, "hidden_size")),)),
        "self_attention.key.kernel": ((0, 2, 3, 1), (Reshape(("num_key_value_heads", -1, "hidden_size")),)),
        "self_attention.value.kernel": ((0, 2, 3, 1), (Reshape(("num_key_value_heads", -1, "hidden_size")),)),
        "self_attention.out.kernel": ((0, 3, 1, 2), (Reshape(("hidden_size", "num_attention_heads", -1)),)),
        "mlp.wi_0.kernel": ((0, 2, 1), ()),
        "mlp.wi_1.kernel": ((0, 2, 1), ()),
        "mlp.wo.kernel": ((0, 2, 1), ()),
    }
    flat, rules = {}, []
    for path, (shape, axes) in mt.logical_axes(config).items():
        hooks = ()
        name = path.removeprefix("params.decoder.layers.")
        if name in swapped:
            order, hooks = swapped[name]
            shape, axes = tuple(shape[d] for d in order), tuple(axes[d] for d in order)
        elif path.endswith("logits_dense.kernel"):
            shape, axes = shape[::-1], axes[::-1]
        flat[path] = jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=logical_to_sharding(axes, shape, mesh,
                                                                                                mt.LOGICAL_RULES))
        rule = mt.TABLE.find(path)[0]
        rules.append(Rule(rule.target, rule.source, hooks or tuple(h for h in rule.hooks if not _is_transpose(h)),
                          fallbacks=rule.fallbacks))
    return mt.nest(flat), MappingTable(tuple(rules), mt.TABLE.ignore)


def _is_transpose(hook) -> bool:
    from otfload.plan.hooks import Transpose

    return isinstance(hook, Transpose)


# --- tunix-style loader ----------------------------------------------------------------------------

_NP_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def tunix_style_load(directory: Path, abstract: dict, config: dict) -> dict:
    """tunix 0.1.7 ``load_and_create_model_opt``'s strategy on the unscanned MaxText-style tree:
    mmapped views, numpy transposes/reshapes as views, one ``jax.device_put(view, sharding)`` per leaf."""
    import jax
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
    import numpy as np

    from otfload.mappings import maxtext_llama as mt
    from otfload.plan.abstract import dotted

    views: dict[str, np.ndarray] = {}
    handles = []
    for path in sorted(directory.glob("*.safetensors")):
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        f = open(path, "rb")  # noqa: SIM115 - kept open with its mapping until the load ends
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        handles.append((f, mm))
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            begin, end = meta["data_offsets"]
            dtype = np.dtype(getattr(ml_dtypes, _NP_DTYPES[meta["dtype"]], None) or _NP_DTYPES[meta["dtype"]])
            count = (end - begin) // dtype.itemsize
            views[name] = np.frombuffer(mm, dtype, count, 8 + n + begin).reshape(meta["shape"])
    out = {}
    for path, sds in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        key = dotted(path)
        rule, fixed, _ = mt.TABLE.find(key)
        view = views[rule.source.format(**fixed)]
        for hook in rule.hooks:  # Transpose / Reshape: views, as tunix's permute + reshape
            view = hook.resolve(config).forward(view)
        out[key] = jax.device_put(view, sds.sharding)
    jax.block_until_ready(out)
    for f, mm in handles:
        del f, mm
    return out


# --- child: one method, one load -------------------------------------------------------------------


def _usage() -> tuple[float, int]:
    """CPU seconds (user + system, every thread) and minor page faults of this process so far."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_minflt


def child(method: str, directory: Path, devices: int) -> dict:
    """Load ``directory`` once with ``method`` and measure it (in a fresh process)."""
    import jax
    import numpy as np

    import otfload
    from benchmarks.baselines import placed_bytes
    from benchmarks.bench_load import warm
    from benchmarks.common import RssSampler, bench_mesh, current_rss, peak_rss
    from otfload.mappings import maxtext_llama as mt
    from otfload.place import transpose
    from otfload.read import arena

    if len(jax.devices()) != devices:
        raise SystemExit(f"expected {devices} devices, JAX has {len(jax.devices())}: is XLA_FLAGS set?")
    mesh = bench_mesh(devices)
    config = json.loads((directory / "config.json").read_text())
    dtype = np.dtype(jax.numpy.bfloat16)
    unscanned = method in ("transposed_unscanned", "tunix_style")
    if method in ("contiguous", "numpy_alloc"):
        abstract, table = contiguous_target(config, mesh, dtype)
    else:
        abstract, table = mt.abstract_params(config, mesh, dtype, scan_layers=not unscanned), mt.TABLE
    if method in ("tiled", "untiled"):
        transpose.XLA_TRANSPOSE = False  # numpy's copies, as before XLA's host transpose was used
    if method == "untiled":
        transpose.MIN_TILED_ELEMENTS = math.inf  # every copy is one np.copyto, as before the tiled kernel
    if method == "numpy_alloc":
        arena.OWN_MAPPING_BYTES = math.inf  # np.empty (THP-advised from 4 MiB), as before 2026-11-25

    def run():
        if method == "tunix_style":
            return tunix_style_load(directory, abstract, config)
        return otfload.load_params(directory, abstract, table, mesh=mesh, progress=False)

    warm(directory)
    gc.collect()
    rss_before = current_rss()
    with RssSampler() as sampler:
        start, (cpu_start, faults_start) = time.perf_counter(), _usage()
        loaded = run()
        jax.block_until_ready(loaded)
        seconds, (cpu, faults) = time.perf_counter() - start, _usage()
        cpu, faults = cpu - cpu_start, faults - faults_start
    checkpoint_bytes = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    return {
        "method": method, "seconds": seconds, "cpu_seconds": cpu, "checkpoint_bytes": checkpoint_bytes,
        "placed_bytes": placed_bytes(loaded), "rss_before": rss_before, "minor_faults": faults,
        "peak_rss": max(peak_rss(), sampler.peak),
    }


# --- parent ----------------------------------------------------------------------------------------


def run_child(method: str, directory: Path, devices: int) -> dict:
    from benchmarks.bench_load import child_env

    cmd = [sys.executable, "-m", "benchmarks.bench_transpose", "--child", method, "--dir", str(directory),
           "--devices", str(devices)]
    return harness.run_child(cmd, child_env(devices), method)


def measure(methods: list[str], directory: Path, devices: int, repeat: int) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    for r in range(repeat):
        for method in methods:
            result = run_child(method, directory, devices)
            runs[method].append(result)
            print(f"  round {r + 1}/{repeat} {method:22s} {result['seconds']:6.2f} s  "
                  f"cpu {result['cpu_seconds']:6.2f} s  peak {result['peak_rss'] / GIB:5.2f} GiB",
                  file=sys.stderr, flush=True)
    out = {}
    for method, rs in runs.items():
        out[method] = {
            **rs[0],
            "seconds": statistics.median(r["seconds"] for r in rs),
            "cpu_seconds": statistics.median(r["cpu_seconds"] for r in rs),
            "all_cpu_seconds": [round(r["cpu_seconds"], 2) for r in rs],
            "minor_faults": statistics.median(r["minor_faults"] for r in rs),
            "all_seconds": [round(r["seconds"], 2) for r in rs],
            "transient": statistics.median(r["peak_rss"] - r["rss_before"] - r["placed_bytes"] for r in rs),
            "peak_over_before": statistics.median(r["peak_rss"] - r["rss_before"] for r in rs),
        }
    return out


def table(results: dict[str, dict]) -> str:
    base = results.get("contiguous")
    rows = ["| method | seconds (median) | runs (s) | GB/s | CPU s (median) | CPU runs (s) | minor faults | "
            "peak − before GiB | transient GiB | speed / contiguous (wall, CPU) |",
            "|---|---:|---|---:|---:|---|---:|---:|---:|---:|"]
    for method, r in results.items():
        rows.append(
            f"| {method} | {r['seconds']:.2f} | {harness.runs_cell(r['all_seconds'])} | "
            f"{r['checkpoint_bytes'] / r['seconds'] / 1e9:.2f} | {r['cpu_seconds']:.2f} | "
            f"{harness.runs_cell(r['all_cpu_seconds'])} | {r['minor_faults']:,.0f} | "
            f"{r['peak_over_before'] / GIB:.2f} | {r['transient'] / GIB:.2f} | {harness.speed_cell(base, r)} |"
        )
    return "\n".join(rows)


def kernel_bench(repeat: int = 7) -> str:
    """One bf16 matrix copied transposed: plain, through XLA, tiled (and its tile sizes), device_put."""
    import jax
    import ml_dtypes
    import numpy as np

    from otfload.place import transpose

    rows, cols = KERNEL_SHAPE
    src = np.random.default_rng(0).integers(0, 1 << 16, (rows, cols), dtype=np.uint16).view(ml_dtypes.bfloat16)
    dst = np.ones((cols, rows), src.dtype)

    def best(fn) -> float:
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times) * 1e3

    lines = [f"{rows}×{cols} bf16 ({src.nbytes / 2**20:.0f} MiB), best of {repeat}, ms:",
             f"  contiguous np.copyto         {best(lambda: np.copyto(dst, src.reshape(cols, rows))):7.2f}",
             f"  transposed np.copyto         {best(lambda: np.copyto(dst, src.T)):7.2f}",
             f"  transposed copy_into (XLA)   {best(lambda: transpose.copy_into(dst, src.T)):7.2f}",
             f"  jax.device_put(src.T)        {best(lambda: jax.device_put(src.T).block_until_ready()):7.2f}"]
    np.testing.assert_array_equal(dst.view(np.uint16), src.T.view(np.uint16))
    defaults = transpose.TILE_SOURCE_ROWS, transpose.TILE_SOURCE_BYTES
    transpose.XLA_TRANSPOSE = False  # numpy's tiled copy from here on
    lines.append(f"  transposed copy_into (tiled) {best(lambda: transpose.copy_into(dst, src.T)):7.2f}")
    for tile_rows in (8, 16, 32):
        for tile_bytes in (512, 2048, 8192):
            transpose.TILE_SOURCE_ROWS, transpose.TILE_SOURCE_BYTES = tile_rows, tile_bytes
            lines.append(f"  tiles of {tile_rows:2d} source rows × {tile_bytes:4d} B  "
                         f"{best(lambda: transpose.copy_into(dst, src.T)):7.2f}")
    transpose.TILE_SOURCE_ROWS, transpose.TILE_SOURCE_BYTES = defaults
    transpose.XLA_TRANSPOSE = True
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, help="checkpoint directory (default: bench_data/llama-<size>g)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--kernel", action="store_true", help="time the copy kernel on one matrix only")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.kernel:
        print(kernel_bench())
        return
    if args.child:
        harness.report(child(args.child, args.dir, args.devices))
        return
    from benchmarks.make_checkpoint import ensure_checkpoint

    directory = args.dir if args.dir is not None else ensure_checkpoint(args.size_gib)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    results = measure(methods, directory, args.devices, args.repeat)
    print(table(results))
    print(f"load average at the end (1, 5, 15 min): {', '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
