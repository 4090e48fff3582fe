"""Time to the first train step: the step compiled while the weights load, against load then compile.

    python -m benchmarks.bench_train_startup                     # presets tiny and small, 3 rounds
    python -m benchmarks.bench_train_startup --preset small --rounds 5 --cold   # reads from disk
    python -m benchmarks.bench_train_startup --platform gpu --preset 1b --rounds 1   # on an accelerator

A synthetic Llama-shaped bf16 checkpoint (``benchmarks.make_checkpoint``) is loaded in float32 on
8 simulated CPU devices (``fsdp=2 x tp=4``; with ``--platform gpu``, the machine's accelerators, all
on ``fsdp``) and ``examples/train.py``'s AdamW step runs once on a
``[2, 128]`` batch. Each measurement is a fresh child process (no compilation cache survives
between them; the checkpoint's pages stay cached after the first round, unless ``--cold`` drops
them before each run), the two ways alternating:

* ``sequential``: ``from_pretrained`` (load), then the step lowered and compiled for the loaded
  model (compile), then the step.
* ``overlapped``: ``otfload.training.load_while_compiling``: the same step compiled against the
  abstract model on a thread while ``from_pretrained`` loads, then the step.

Printed: one Markdown row per preset with the medians of the sequential load and compile, the time
to the first step's loss both ways, and the ratios ``overlapped ready / max(load, compile)`` (1.0:
perfect overlap; the target is at most 1.1), ``overlapped first step / sequential first step``, and
the CPU seconds (every thread) each spent until ready: overlapping adds no work, so what it saves in
wall time is bounded by the cores the load and the compiler leave idle (the load average of the
machine is printed to stderr before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.bench_eval import PRESETS as EVAL_PRESETS
from benchmarks.make_checkpoint import ensure_written

ROOT = Path("bench_data") / "train_startup"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.py"
PRESETS = {name: EVAL_PRESETS[name] for name in ("tiny", "small", "1b")}  # 13 M, 160 M, 1.1 B parameters
BATCH = (2, 128)
MESH = "fsdp=2,tp=4"
DEVICES = 8  # simulated CPU devices; an accelerator machine's own devices all go on fsdp


def child(mode: str, checkpoint: str, mesh_spec: str) -> dict[str, float]:
    """One measurement in this (fresh) process: seconds from the start to each milestone."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import otfload
    from otfload.training import abstract_model, abstract_optimizer, load_while_compiling, place_like, shardings_of

    example = runpy.run_path(str(EXAMPLE), run_name="bench")
    tx = optax.adamw(example["LEARNING_RATE"])
    mesh = otfload.make_mesh(mesh_spec or None)
    vocab = json.loads((Path(checkpoint) / "config.json").read_text())["vocab_size"]
    ids = jax.device_put(jnp.asarray(np.random.default_rng(0).integers(0, vocab, BATCH), jnp.int32),
                         NamedSharding(mesh, P()))  # type: ignore[no-untyped-call]

    def compile_step(model: Any) -> tuple[Any, Any]:
        opt_shape = abstract_optimizer(model, tx, mesh)
        step = nnx.jit(example["train_step"], in_shardings=(shardings_of(model), shardings_of(opt_shape),
                                                            ids.sharding))
        shape = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=ids.sharding)  # type: ignore[no-untyped-call]
        return step.lower(model, opt_shape, shape).compile(), opt_shape

    start = time.perf_counter()
    if mode == "overlapped":
        startup = load_while_compiling(checkpoint, compile_step, mesh=mesh, dtype=jnp.float32)
        model, (step, opt_shape) = startup.model, startup.compiled
        times = {"planned": startup.times.planned, "load": startup.times.loaded,
                 "compile": startup.times.compiled - startup.times.planned}
    else:
        model = otfload.from_pretrained(checkpoint, mesh=mesh, dtype=jnp.float32)
        loaded = time.perf_counter() - start
        with jax.set_mesh(mesh):  # the same compile as overlapped, its abstract model planned again
            step, opt_shape = compile_step(abstract_model(checkpoint, mesh=mesh, dtype=jnp.float32))
        times = {"load": loaded, "compile": time.perf_counter() - start - loaded}
    ready, cpu = time.perf_counter() - start, time.process_time()  # CPU seconds of every thread
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    place_like(optimizer, opt_shape)
    with jax.set_mesh(mesh):
        float(step(model, optimizer, ids))
    return {**times, "ready": ready, "cpu": cpu, "first_step": time.perf_counter() - start}


def run_child(mode: str, checkpoint: Path, cold: bool = False, platform: str = "cpu") -> dict[str, float]:
    """One fresh process's times, with the machine's 1-minute load average before it started."""
    if cold:
        harness.drop_caches(checkpoint, files_only=True)
    before = os.getloadavg()[0]
    mesh = MESH if platform == "cpu" else ""  # "": every device on fsdp
    result = harness.run_child("benchmarks.bench_train_startup", ["--child", mode, str(checkpoint), mesh],
                               devices=DEVICES if platform == "cpu" else 1, platform=platform,
                               env={"TQDM_DISABLE": "1"}, what=mode)  # fmt: skip
    return {**result, "load_average": before}


def progress(r: Mapping[str, Any]) -> str:
    """A run's line on stderr: its phases, CPU seconds and the load average it started under."""
    return (f"load {r['load']:5.2f} s  compile {r['compile']:5.2f} s  ready {r['ready']:5.2f} s  first step"
            f" {r['first_step']:6.2f} s  CPU {r['cpu']:5.1f} s  load average {r['load_average']:.1f}")


def measure(preset: str, rounds: int, cold: bool = False, platform: str = "cpu") -> dict[str, Any]:
    dims = PRESETS[preset]
    checkpoint = ensure_written(ROOT / preset, dims)
    run_child("sequential", checkpoint, platform=platform)  # warm the page cache and the imports
    runs = harness.rounds(["sequential", "overlapped"], rounds,
                          lambda mode: run_child(mode, checkpoint, cold, platform),
                          line=progress)

    def median(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    load, compile_ = median("sequential", "load"), median("sequential", "compile")
    overlapped = median("overlapped", "ready")
    return {"cpu_sequential": median("sequential", "cpu"), "cpu_overlapped": median("overlapped", "cpu"),
            "preset": preset, "params_m": dims.nbytes / 2 / 1e6, "load": load, "compile": compile_,
            "sequential_first": median("sequential", "first_step"),
            "overlapped_ready": overlapped, "overlapped_first": median("overlapped", "first_step"),
            "vs_max": overlapped / max(load, compile_),
            "vs_sequential": median("overlapped", "first_step") / median("sequential", "first_step"),
            "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), action="append")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", nargs=3, metavar=("MODE", "CHECKPOINT", "MESH"), help=argparse.SUPPRESS)
    parser.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                        help="cpu: 8 simulated CPU devices; gpu: the machine's accelerators")
    parser.add_argument("--json", action="store_true", help="print the raw runs as JSON too")
    parser.add_argument("--cold", action="store_true",
                        help="drop the checkpoint files' pages before every run (posix_fadvise DONTNEED)")
    args = parser.parse_args()
    if args.child:
        harness.report(child(*args.child))
        return
    print(harness.table(["preset", "params", "load s", "compile s", "load then compile: first step s",
                         "overlapped: ready s", "overlapped: first step s", "ready / max(load, compile)",
                         "first step vs sequential", "CPU s to ready: sequential / overlapped"], []))  # fmt: skip
    print(f"before: {harness.machine_line()}", file=sys.stderr)
    for preset in args.preset or ["tiny", "small"]:
        r = measure(preset, args.rounds, args.cold, args.platform)
        print(harness.row([preset, f"{r['params_m']:.0f} M", f"{r['load']:.2f}", f"{r['compile']:.2f}",
                           f"{r['sequential_first']:.2f}", f"{r['overlapped_ready']:.2f}",
                           f"{r['overlapped_first']:.2f}", f"{r['vs_max']:.2f}x", f"{r['vs_sequential']:.2f}x",
                           f"{r['cpu_sequential']:.1f} / {r['cpu_overlapped']:.1f}"]), flush=True)
        if args.json:
            print(json.dumps(r["runs"]))
    print(f"after: {harness.load_line()}", file=sys.stderr)


if __name__ == "__main__":
    main()
