"""``otfload inspect``: print the load plan — computed from headers and config alone.

For every target leaf: the HF keys it is built from, the hooks, shape, dtype, sharding, and the
bytes this process reads for it. ``process_bytes`` follows the builder exactly: the local devices'
shard boxes are carried back through the hooks (:func:`~otfload.plan.hooks.chain_needed`), the
bounding box of those source boxes is read once from each HF tensor a local shard stacks, so the
count is ``stacked tensors needed × bytes of that box`` (gaps the reader coalesces are not counted).
"""

from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Iterable
from typing import Any

import numpy as np

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("inspect", help="print the load plan (reads headers and config only)",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(run=run)


def leaf_boxes(plan, devices: Iterable | None = None) -> set:
    """The distinct shard boxes of ``plan``'s leaf on ``devices`` (default: this process's)."""
    from otfload.plan.boxes import box_from_index

    leaf = plan.leaf
    chosen = leaf.sharding.addressable_devices if devices is None else set(devices)
    index_map = leaf.sharding.devices_indices_map(leaf.shape)
    return {box_from_index(index, leaf.shape) for device, index in index_map.items() if device in chosen}


def process_bytes(plan, devices: Iterable | None = None) -> int:
    """Source bytes the builder reads for the shards of ``devices`` (default: this process's),
    every stored part of quantized tensors (codes, scales, zero points) included."""
    from otfload.build.builder import bounding_box
    from otfload.plan.hooks import chain_needed
    from otfload.read.reader import stored_box_bytes

    boxes = leaf_boxes(plan, devices)
    if not boxes or not plan.sources:
        return 0
    n = len(plan.stack_axes)
    union = bounding_box([chain_needed(plan.hooks, plan.shapes, box[n:]) for box in boxes])
    stacked = set().union(*(itertools.product(*(range(a, b) for a, b in box[:n])) for box in boxes))
    total = 0
    for combo in stacked:
        i = int(np.ravel_multi_index(combo, plan.stack_shape)) if n else 0
        total += stored_box_bytes(plan.sources[i], union)
    return total


def shard_bytes(plan) -> int:
    """Bytes of the leaf's largest device shard, in the target dtype (what one device holds)."""
    from otfload.plan.boxes import box_from_index, box_nbytes

    leaf = plan.leaf
    return max(box_nbytes(box_from_index(index, leaf.shape), leaf.dtype.itemsize)
               for index in leaf.sharding.devices_indices_map(leaf.shape).values())


def inspect_source(source: Any, **kwargs) -> dict:
    """The plan of ``source`` as a JSON-able dict; ``kwargs`` go to :func:`otfload.plan_model`.

    Reads headers and ``config.json`` only; a checkpoint that does not fit the model raises
    :class:`~otfload.errors.CheckpointMismatchError`.
    """
    import jax

    from otfload.api import plan_model
    from otfload.families.registry import family_for
    from otfload.index.checkpoint import CONFIG_FILE, read_json

    _, plan, src = plan_model(source, **kwargs)
    try:
        config = read_json(src, CONFIG_FILE)
        description = src.description
    finally:
        src.close()
    mesh = next(iter(plan.leaves.values())).leaf.sharding.mesh if plan.leaves else None
    leaves = [{**p.describe(), "process_bytes": process_bytes(p), "shard_bytes": shard_bytes(p)}
              for p in plan.leaves.values()]
    return {
        "source": description,
        "model_type": config.get("model_type"),
        "family": family_for(config).name,
        "mesh": {k: int(v) for k, v in mesh.shape.items()} if mesh is not None else {},
        "devices": mesh.size if mesh is not None else 0,
        "processes": jax.process_count(),
        "scan_layers": kwargs.get("scan_layers", True),
        "leaves": leaves,
        "unused": list(plan.unused),
        "totals": {
            "leaves": len(leaves),
            "hf_tensors": sum(leaf["num_hf_keys"] for leaf in leaves),
            "source_bytes": plan.source_bytes,
            "process_bytes": sum(leaf["process_bytes"] for leaf in leaves),
            "device_bytes": sum(leaf["shard_bytes"] for leaf in leaves),
        },
    }


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_plan(info: dict) -> str:
    """The human-readable plan."""
    mesh = ", ".join(f"{k}={v}" for k, v in info["mesh"].items())
    lines = [
        f"source       {info['source']}",
        f"model        {info['model_type']} (family {info['family']}), scan_layers={info['scan_layers']}",
        f"mesh         {mesh} ({info['devices']} devices, {info['processes']} process(es))",
        "",
    ]
    for leaf in info["leaves"]:
        keys = " … ".join(k for k in leaf["hf_keys"] if not k.startswith("... "))
        stacked = f" ({leaf['num_hf_keys']} keys, stacked on {', '.join(leaf['stack_axes'])})" \
            if leaf["stack_axes"] else ""
        lines.append(f"{leaf['leaf']}  {tuple(leaf['shape'])} {leaf['dtype']}  {leaf['sharding']}  "
                     f"{human_bytes(leaf['process_bytes'])}/process")
        lines.append(f"    ← {keys}{stacked}  [{leaf['storage']}]")
        if leaf["hooks"]:
            lines.append(f"    hooks: {', '.join(leaf['hooks'])}")
    t = info["totals"]
    lines += [
        "",
        f"{t['leaves']} leaves from {t['hf_tensors']} HF tensors ({human_bytes(t['source_bytes'])}); "
        f"this process reads {human_bytes(t['process_bytes'])}; "
        f"largest device shard total {human_bytes(t['device_bytes'])}",
        f"unused tensors ({len(info['unused'])}): {', '.join(info['unused']) or 'none'}",
    ]
    return "\n".join(lines)


def format_problems(error) -> str:
    lines = [f"the checkpoint does not fit the model: {len(error.problems)} problem(s)"]
    for kind in ("missing", "shape", "unexpected"):
        lines += [f"  {p.describe()}" for p in error.problems if p.kind == kind]
    return "\n".join(lines)


def problems_json(error) -> dict:
    fields = ("kind", "hf_key", "leaf", "expected", "actual", "file")
    return {"problems": [{f: _jsonable(getattr(p, f)) for f in fields} for p in error.problems]}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (int, str)):
        return value
    return list(value) if isinstance(value, tuple) else str(value)


def run(args: argparse.Namespace) -> int:
    from otfload.errors import CheckpointMismatchError

    try:
        info = inspect_source(args.source, **options.layout_kwargs(args), **options.source_options(args))
    except CheckpointMismatchError as e:
        print(json.dumps(problems_json(e), indent=1) if args.json else format_problems(e))
        return 1
    print(json.dumps(info, indent=1) if args.json else format_plan(info))
    return 0
