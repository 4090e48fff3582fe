"""Transposed (``[in, out]``) loads against contiguous ones, and against a tunix-style loader.

    python -m benchmarks.bench_transpose --size-gib 1.0 --repeat 3 [--methods ...] [--devices 8]
    python -m benchmarks.bench_transpose --kernel          # the copy kernel alone, on one matrix

The checkpoint is ``benchmarks.make_checkpoint``'s Llama-shaped bf16 one. Every method loads the
same weights onto the same devices (mesh ``fsdp × tp``, 8 simulated CPU devices by default) in a
fresh process, warm page cache, interleaved rounds, medians:

* ``contiguous`` — ``otfload.load_params`` into the Linen-style tree with every projection kept
  ``[out, in]`` (HF's orientation: hooks are reshapes, the copy is contiguous);
* ``transposed`` — the same with ``[in, out]`` kernels: ``otfload.mappings.linen_llama``'s
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
import json
import math
import mmap
from pathlib import Path

from benchmarks import harness

METHODS = ("contiguous", "numpy_alloc", "transposed", "tiled", "untiled", "transposed_unscanned", "tunix_style")
GIB = harness.GIB
KERNEL_SHAPE = (2048, 5632)  # a 22 MiB bf16 matrix, the example


# --- the trees -------------------------------------------------------------------------------------


def contiguous_target(config: dict, mesh, dtype) -> tuple[dict, object]:
    """The Linen-style tree with every projection ``[out, in]``, and its table (no transpose)."""
    import jax
    import numpy as np

    from otfload.mappings import linen_llama as mt
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
    """tunix 0.1.7 ``load_and_create_model_opt``'s strategy on the unscanned Linen-style tree:
    mmapped views, numpy transposes/reshapes as views, one ``jax.device_put(view, sharding)`` per leaf."""
    import jax
    import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy
    import numpy as np

    from otfload.mappings import linen_llama as mt
    from otfload.plan.abstract import dotted

    views: dict[str, np.ndarray] = {}
    handles = []
    for path in sorted(directory.glob("*.safetensors")):
        header, data_start = harness.safetensors_header(path)
        f = open(path, "rb")  # noqa: SIM115 - kept open with its mapping until the load ends
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        handles.append((f, mm))
        for name, meta in header.items():
            begin, end = meta["data_offsets"]
            dtype = np.dtype(getattr(ml_dtypes, _NP_DTYPES[meta["dtype"]], None) or _NP_DTYPES[meta["dtype"]])
            count = (end - begin) // dtype.itemsize
            views[name] = np.frombuffer(mm, dtype, count, data_start + begin).reshape(meta["shape"])
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


def child(method: str, directory: Path, devices: int) -> dict:
    """Load ``directory`` once with ``method`` and measure it (in a fresh process)."""
    import jax
    import numpy as np

    import otfload
    from benchmarks.baselines import placed_bytes
    from benchmarks.target import bench_mesh, check_devices
    from otfload.mappings import linen_llama as mt
    from otfload.place import transpose
    from otfload.read import arena

    check_devices(devices)
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

    harness.warm(directory)
    with harness.measured() as measured:
        loaded = run()
        jax.block_until_ready(loaded)
    placed = placed_bytes(loaded)
    return {"method": method, **measured, "checkpoint_bytes": harness.tensor_bytes(directory), "placed_bytes": placed,
            "transient": measured["peak_over_before"] - placed}  # fmt: skip


# --- parent ----------------------------------------------------------------------------------------


def run_child(method: str, directory: Path, devices: int) -> dict:
    args = ["--child", method, "--dir", str(directory), "--devices", str(devices)]
    return harness.run_child("benchmarks.bench_transpose", args, devices=devices, what=method)


def measure(methods: list[str], directory: Path, devices: int, repeat: int) -> dict[str, dict]:
    runs = harness.rounds(methods, repeat, lambda m: run_child(m, directory, devices))
    return {m: harness.summarize(rs, ("minor_faults", "transient", "peak_over_before")) for m, rs in runs.items()}


def table(results: dict[str, dict]) -> str:
    base = results.get("contiguous")
    columns = ["method", "seconds (median)", "runs (s)", "GB/s", "CPU s (median)", "CPU runs (s)", "minor faults",
               "peak − before GiB", "transient GiB", "speed / contiguous (wall, CPU)"]  # fmt: skip
    rows = [[method, f"{r['seconds']:.2f}", harness.runs_cell(r["all_seconds"]),
             f"{r['checkpoint_bytes'] / r['seconds'] / 1e9:.2f}", f"{r['cpu_seconds']:.2f}",
             harness.runs_cell(r["all_cpu_seconds"]), f"{r['minor_faults']:,.0f}", f"{r['peak_over_before'] / GIB:.2f}",
             f"{r['transient'] / GIB:.2f}", harness.speed_cell(base, r)] for method, r in results.items()]  # fmt: skip
    return harness.table(columns, rows)


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
        return min(harness.times(fn, repeat, warmup=0)) * 1e3

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
    print(f"at the end: {harness.load_line()}")


if __name__ == "__main__":
    main()
