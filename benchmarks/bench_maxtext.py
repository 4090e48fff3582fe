"""MaxText's own on-the-fly loader against otfload's drop-in, into MaxText's real tree (maxtext 0.2.5).

    PYTHONPATH=. .venv-maxtext/bin/python -m benchmarks.bench_maxtext --size-gib 1.0 --repeat 3 [--cold]

Runs in the MaxText venv (``scripts/make_maxtext_venv.sh``). The checkpoint is a float32 Llama-shaped
one (HF key names, ``head_dim`` 128, random values, shards of at most ~1 GB) written once into
``--work``. Each run is a fresh process on 8 simulated CPU devices (``ici_fsdp_parallelism=2,
ici_tensor_parallelism=4``): MaxText's ``pyconfig`` for ``llama3.1-8b`` with the checkpoint's sizes
and one layout (``scan_layers`` with ``param_scan_axis`` 1 or 0, or unscanned), its abstract NNX
model (``create_nnx_abstract_model``), then, timed, one call with the same arguments:

* ``maxtext`` — ``load_dynamic.load_safetensors_dynamic_state(path, params, config)`` (Orbax v1's
  safetensors layout read onto the devices, then MaxText's hooks and stacking as JAX ops);
* ``otfload`` — ``otfload.maxtext.load_state(path, params, config)``.

The clock stops when every returned array is ready. No warm-up load: each method's first-call
costs (JAX compiling its hooks and stacks) are part of its load, as in a real run. Warm page cache
(every file read before each run), methods interleaved round by round, medians. ``--cold``: the
same with the page cache dropped before each run. Memory: the run's peak RSS, and its transient host
memory (peak RSS minus RSS before the call; the arrays themselves live in host memory too on CPU
devices, so both methods carry the tree's own bytes in it: "beyond the tree" takes them off, the
figure to hold against the largest leaf). The checks (every leaf bitwise equal,
sharding, dtype) are the tests' (``tests/maxtext``), not repeated here.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from benchmarks import harness
from benchmarks.make_checkpoint import Dims, choose_dims, ensure_written, random_bf16

METHODS = ("maxtext", "otfload")
LAYOUTS = {"scan-axis1": (True, 1), "scan-axis0": (True, 0), "unscanned": (False, 1)}
DEFAULT_WORK = Path("/tmp/otfload-bench-maxtext")
MODEL_NAME = "llama3.1-8b"


def _f32(name: str, shape: tuple[int, ...], rng):
    import numpy as np

    if name.endswith("norm.weight"):
        return np.ones(shape, np.float32)
    return random_bf16(shape, rng).astype(np.float32)


def ensure_checkpoint(directory: Path, size_gib: float) -> tuple[Path, Dims]:
    """The float32 Llama checkpoint of about ``size_gib`` in ``directory`` (``Dims`` count bf16 bytes)."""
    dims = choose_dims(int(size_gib * harness.GIB / 2))
    ensure_written(directory, dims, values=_f32, shard_bytes=500 * 10**6)  # bf16 bytes: ~1 GB files in f32
    index = directory / "model.safetensors.index.json"
    meta = json.loads(index.read_text())
    total = sum(4 * math.prod(shape) for _, shape in dims.tensors())
    if meta["metadata"]["total_size"] != total:
        meta["metadata"]["total_size"] = total
        index.write_text(json.dumps(meta, indent=1))
    return directory, dims


# --- a run, in its child ---------------------------------------------------------------------------


def child(method: str, directory: Path, dims: Dims, layout: str, cold: bool) -> None:
    """Build MaxText's abstract tree for ``layout`` and time ``method``'s load into it (reported)."""
    import jax
    import transformers
    from flax import nnx
    from maxtext.checkpoint_conversion.utils import hf_model_configs, load_dynamic
    from maxtext.configs import pyconfig
    from maxtext.utils import model_creation_utils

    scan_layers, axis = LAYOUTS[layout]
    config = pyconfig.initialize(
        [""], model_name=MODEL_NAME, override_model_config=True, hardware="cpu", attention="dot_product",
        skip_jax_distributed_system=True, ici_fsdp_parallelism=2, ici_tensor_parallelism=4,
        base_emb_dim=dims.hidden, base_num_query_heads=dims.heads, base_num_kv_heads=dims.kv_heads,
        head_dim=dims.head_dim, base_mlp_dim=dims.intermediate, base_num_decoder_layers=dims.layers,
        vocab_size=dims.vocab, scan_layers=scan_layers, param_scan_axis=axis,
    )  # fmt: skip
    hf_model_configs.HF_MODEL_CONFIGS[MODEL_NAME] = transformers.LlamaConfig.from_pretrained(directory)
    _, model = model_creation_utils.create_nnx_abstract_model(config)
    params = nnx.state(model, nnx.Param)
    if method == "maxtext":
        load = load_dynamic.load_safetensors_dynamic_state
    else:
        from otfload.maxtext import load_state as load
    if not cold:
        harness.warm(directory)
    with harness.measured() as figures:
        _, tree = load(str(directory), params, config)
        jax.block_until_ready(tree)
    leaves = jax.tree.leaves(tree)
    figures.update(leaves=len(leaves), largest_leaf=max(x.nbytes for x in leaves),
                   tree_bytes=sum(x.nbytes for x in leaves))
    harness.report(figures)


# --- the parent --------------------------------------------------------------------------------------


def run(method: str, layout: str, args: argparse.Namespace, directory: Path) -> dict:
    """One run of ``method`` in ``layout``, in a fresh process."""
    if args.cold:
        harness.drop_caches(directory)
    child_args = ["--child", method, "--layout", layout, "--work", str(args.work), "--size-gib", str(args.size_gib)]
    if args.cold:
        child_args.append("--cold")
    return harness.run_child("benchmarks.bench_maxtext", child_args, devices=8, what=f"{method} {layout}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--cold", action="store_true", help="drop the page cache before each run")
    parser.add_argument("--child", choices=METHODS, help=argparse.SUPPRESS)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    directory, dims = ensure_checkpoint(args.work / f"llama-f32-{args.size_gib:g}g", args.size_gib)
    if args.child:
        child(args.child, directory, dims, args.layout, args.cold)
        return
    print(harness.machine_line())
    print(harness.checkpoint_line(directory) + ", float32")
    page_cache = "cold (page cache dropped before each run)" if args.cold else "warm"
    print(f"{page_cache}, 8 simulated CPU devices (fsdp 2 x tensor 4), median of {args.repeat} interleaved rounds\n")
    print(harness.table(["layout", "method", "seconds (runs)", "median s", "speed-up", "peak RSS GiB",
                         "transient GiB", "beyond the tree GiB", "largest leaf GiB", "load avg"], []))
    verdicts = []
    for layout in args.layouts.split(","):
        runs = harness.rounds(METHODS, args.repeat, lambda m, layout=layout: run(m, layout, args, directory))
        summary = {m: harness.summarize(r, ("peak_rss", "peak_over_before", "loadavg")) for m, r in runs.items()}
        base = summary["maxtext"]
        for method in METHODS:
            s = summary[method]
            print(harness.row([layout, method, harness.runs_cell(s["all_seconds"]), f"{s['seconds']:.2f}",
                               harness.speed_cell(base, s) if method != "maxtext" else "",
                               f"{s['peak_rss'] / harness.GIB:.2f}", f"{s['peak_over_before'] / harness.GIB:.2f}",
                               f"{(s['peak_over_before'] - s['tree_bytes']) / harness.GIB:.2f}",
                               f"{s['largest_leaf'] / harness.GIB:.3f}", f"{s['loadavg']:.1f}"]), flush=True)
        verdicts.append((layout, base["seconds"] / summary["otfload"]["seconds"]))
    print()
    for layout, ratio in verdicts:
        verdict = 'meets' if ratio >= 5 else 'MISSES'
        print(f"{layout}: otfload {ratio:.2f}x MaxText's loader: {verdict} the >= 5x target")
    print(harness.load_line(), "(at the end)")


if __name__ == "__main__":
    main()
