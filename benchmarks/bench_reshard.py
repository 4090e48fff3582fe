"""Restore time onto a 2x4 mesh from a native checkpoint saved on another layout vs its resharded copy,
and vs otfload's on-the-fly load of the same tensors from HF safetensors.

Usage: python -m benchmarks.bench_reshard [--mib 256] [--leaves 16] [--repeats 7] [--part-mib 64]

Save, reshard and restore each run in their own process (8 simulated CPU devices), so each peak RSS
is that phase's own. The restore process alternates between the two checkpoints (warm page cache)
so that machine noise hits both alike; the median is reported.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import harness

SOURCE_MESH = {"fsdp": 8}
TARGET_MESH = {"fsdp": 2, "tp": 4}
AXES = ("embed", "mlp")  # DEFAULT_RULES: embed -> fsdp, mlp -> tp


def _leaf_shape(mib: int, leaves: int) -> tuple[int, int]:
    side = int((mib * 2**20 / leaves / 4) ** 0.5) // 64 * 64
    return side, side


def _abstract(mesh_axes: dict[str, int], args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    from otfload.plan.sharding import logical_to_sharding, make_mesh

    shape = _leaf_shape(args.mib, args.leaves)
    sharding = logical_to_sharding(AXES, shape, make_mesh(mesh_axes))
    return {f"w{i}": jax.ShapeDtypeStruct(shape, np.float32, sharding=sharding) for i in range(args.leaves)}


def phase_save(args: argparse.Namespace) -> dict:
    import jax
    import numpy as np

    from otfload.checkpoint import CheckpointConfig, LayoutMetadata, OrbaxCheckpointManager

    rng = np.random.default_rng(0)
    specs = _abstract(SOURCE_MESH, args)
    state = {k: jax.device_put(rng.random(s.shape, np.float32), s.sharding) for k, s in specs.items()}
    meta = LayoutMetadata(scan_layers=False, logical_axes={k: AXES for k in state})
    start = time.perf_counter()
    with OrbaxCheckpointManager(CheckpointConfig(args.workdir / "src", async_save=False)) as manager:
        manager.save(0, state, metadata=meta)
    seconds = time.perf_counter() - start
    _save_as_hf(state, args.workdir / "hf")
    return {"save": [seconds]}


def _save_as_hf(state: dict, path: Path) -> None:
    """The same tensors as an HF safetensors checkpoint (one file per 4 leaves, with an index)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True)
    weight_map = {}
    keys = sorted(state)
    for start in range(0, len(keys), 4):
        name = f"model-{start // 4:05d}.safetensors"
        save_file({k: np.asarray(state[k]) for k in keys[start : start + 4]}, path / name)
        weight_map.update({k: name for k in keys[start : start + 4]})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def phase_reshard(args: argparse.Namespace) -> dict:
    from otfload.checkpoint import reshard_checkpoint

    start = time.perf_counter()
    reshard_checkpoint(
        args.workdir / "src", args.workdir / "dst", TARGET_MESH, max_part_bytes=args.part_mib * 2**20
    )
    return {"reshard": [time.perf_counter() - start]}


def phase_restore(args: argparse.Namespace) -> dict:
    import jax

    import otfload
    from otfload.checkpoint import CheckpointConfig, OrbaxCheckpointManager

    target = _abstract(TARGET_MESH, args)
    times: dict[str, list[float]] = {"src": [], "dst": [], "hf": []}
    managers = {k: OrbaxCheckpointManager(CheckpointConfig(args.workdir / k)) for k in ("src", "dst")}
    mapping = {k: k for k in target}
    for _ in range(args.repeats):
        for which, manager in managers.items():
            start = time.perf_counter()
            jax.block_until_ready(manager.restore(0, target, scan_layers=False))
            times[which].append(time.perf_counter() - start)
        start = time.perf_counter()
        jax.block_until_ready(otfload.load_params(args.workdir / "hf", target, mapping, progress=False))
        times["hf"].append(time.perf_counter() - start)
    for manager in managers.values():
        manager.close()
    return times


PHASES = {"save": phase_save, "reshard": phase_reshard, "restore": phase_restore}


def _run_phase(args: argparse.Namespace, phase: str) -> dict:
    cmd = ["--phase", phase, "--workdir", str(args.workdir), "--mib", str(args.mib), "--leaves", str(args.leaves),
           "--repeats", str(args.repeats), "--part-mib", str(args.part_mib)]  # fmt: skip
    return harness.run_child("benchmarks.bench_reshard", cmd, devices=8, what=phase)


def _report(args: argparse.Namespace) -> None:
    rows, cols = _leaf_shape(args.mib, args.leaves)
    mib = rows * cols * 4 * args.leaves / 2**20
    print(f"checkpoint: {args.leaves} x f32[{rows},{cols}] = {mib:.0f} MiB, logical axes {AXES}")
    print(f"saved on {SOURCE_MESH}, restored onto {TARGET_MESH}; reshard parts of {args.part_mib} MiB")
    print(f"restores: median of {args.repeats}, alternating, warm page cache\n")
    save, reshard, restore = (_run_phase(args, p) for p in PHASES)
    rows_out = [
        ("save on fsdp=8 (one-off)", save["save"], save),
        ("reshard to fsdp=2,tp=4 (one-off)", reshard["reshard"], reshard),
        ("restore from fsdp=8 checkpoint", restore["src"], restore),
        ("restore from resharded checkpoint", restore["dst"], restore),
        ("otfload on-the-fly from HF safetensors", restore["hf"], restore),
    ]
    cells = [[name, f"{statistics.median(times):.3f}", f"{mib / 1024 / statistics.median(times):.2f}",
              f"{phase['peak_rss_mib']:.0f}"] for name, times, phase in rows_out]  # fmt: skip
    print(harness.table(["phase", "seconds", "GiB/s", "peak RSS MiB"], cells))
    ratio = statistics.median(restore["src"]) / statistics.median(restore["dst"])
    print(f"\nrestore speed-up from resharding (median): {ratio:.2f}x")
    print("restore seconds src:", " ".join(f"{t:.3f}" for t in restore["src"]))
    print("restore seconds dst:", " ".join(f"{t:.3f}" for t in restore["dst"]))
    print("otfload seconds hf: ", " ".join(f"{t:.3f}" for t in restore["hf"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="checkpoint size in MiB")
    parser.add_argument("--leaves", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7, help="restores per checkpoint")
    parser.add_argument("--part-mib", type=int, default=64, help="reshard's max_part_bytes, in MiB")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--phase", choices=sorted(PHASES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        result = PHASES[args.phase](args)
        harness.report({**result, "peak_rss_mib": harness.peak_rss() / 2**20})
        return
    own_dir = args.workdir is None
    args.workdir = Path(tempfile.mkdtemp(prefix="bench_reshard_")) if own_dir else args.workdir
    try:
        _report(args)
    finally:
        if own_dir:
            shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
