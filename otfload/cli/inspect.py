"""``otfload inspect``: print the load plan — computed from headers and config alone.

For every target leaf: the HF keys it is built from, the hooks, shape, dtype, sharding, and the
bytes one process reads for it (this one, or ``--process-index`` of ``--process-count`` processes
sharing the mesh's devices in order — planned without ``jax.distributed``). Three counts follow the
builder exactly (the plan's byte counts, :mod:`otfload.plan.leaf_bytes`): ``process_bytes``, the source
bytes its devices' boxes need, each HF tensor once (boxes carried back through the hooks, holes of
widening hooks skipped); ``fetch_bytes``, what the reader fetches for them (whole pages of local
files, gaps merged to save requests, in the layout :mod:`otfload.place.collective_route` chooses: a band
read resharded on the devices); and ``ideal_bytes``, the source bytes of the elements the devices hold.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from otfload.cli import options

if TYPE_CHECKING:  # the command imports JAX and the pipeline only when it runs
    import jax
    from jax.sharding import Mesh

    from otfload.errors import CheckpointMismatchError
    from otfload.options import LoadOptions
    from otfload.plan.planner import LoadPlan
    from otfload.read.reader import TensorReader

Info = dict[str, Any]  # JSON-able


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("inspect", help="print the load plan (reads headers and config only)",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--process-index", type=int, default=None, metavar="I",
                   help="plan for process I of --process-count processes (default: this process)")
    p.add_argument("--process-count", type=int, default=None, metavar="P",
                   help="processes sharing the mesh's devices, each a contiguous block in mesh order")
    p.add_argument("--platform", choices=("cpu", "gpu", "tpu"), default=None,
                   help="the devices' platform, for the reshard time model's interconnect (default: this one's)")
    options.add_load_args(p)
    p.add_argument("--mapping", metavar="MODULE:TABLE",
                   help="a mapping table (or a function of config.json returning one) for a model you bring, "
                        "e.g. otfload.mappings.linen_llama:TABLE; needs --target")
    p.add_argument("--target", metavar="MODULE:FACTORY",
                   help="a function (config.json dict, mesh) -> abstract nnx.Module, nnx.State or pytree of "
                        "ShapeDtypeStruct, called under jax.set_mesh; "
                        "e.g. otfload.mappings.linen_llama:abstract_params")
    p.set_defaults(run=run)


def process_devices(
    mesh: Mesh, process_index: int | None, process_count: int | None
) -> tuple[list[jax.Device], Callable[[jax.Device], int] | None]:
    """``(devices, process_of)`` of one process: this one's (``process_of`` None), or block
    ``process_index`` of ``process_count`` equal blocks of the mesh's devices in mesh order."""
    from otfload.errors import OtfloadError

    if process_count is None and process_index is None:
        import jax

        return [d for d in mesh.devices.flat if d.process_index == jax.process_index()], None
    count, index = process_count or 1, process_index or 0
    flat = list(mesh.devices.flat)
    if count < 1 or len(flat) % count or not 0 <= index < count:
        raise OtfloadError(f"--process-index {index} of --process-count {count}: the count must divide the "
                           f"{len(flat)} devices and the index be below it")
    per = len(flat) // count
    position = {d: i for i, d in enumerate(flat)}
    return flat[index * per : (index + 1) * per], lambda d: position[d] // per


def process_leaves(
    plan: LoadPlan, reader: TensorReader, devices: list[jax.Device], process_of: Callable[[jax.Device], int] | None,
    policy: str, platform: str | None = None,
) -> tuple[dict[str, Info], Info]:
    """Per leaf of ``plan``: what one process fetches for it (and in how many requests, in which
    layout); and the fetch totals (:mod:`otfload.read.planned`'s)."""
    from otfload.place.collective_route import choose_read_shardings
    from otfload.plan.process_bytes import fetch_totals
    from otfload.read.planned import planned_fetches

    choices = choose_read_shardings(plan.leaves, reader, policy, process_of=process_of, platform=platform)
    bands = {path: choice.sharding for path, choice in choices.items() if choice is not None}
    fetches = planned_fetches(plan, reader, bands, devices)
    out = {path: {"fetch_bytes": f.nbytes, "requests": f.requests,
                  "read_as": None if (band := bands.get(path)) is None else str(band.spec)}
           for path, f in fetches.items()}
    fetched = fetch_totals(fetches.values())
    return out, {"fetch_bytes": fetched.nbytes, "requests": fetched.requests} if out else {}


def inspect_source(
    source: Any, *, process_index: int | None = None, process_count: int | None = None, reshard: str = "auto",
    platform: str | None = None, options: LoadOptions | None = None, **keywords: Any,
) -> Info:
    """The plan of ``source`` as a JSON-able dict; ``options`` and ``keywords`` go to
    :func:`otfload.plan_model`.

    Reads headers and ``config.json`` only; a checkpoint that does not fit the model raises
    :class:`~otfload.errors.CheckpointMismatchError`.
    """

    from otfload.api import plan_model
    from otfload.options import resolve_options
    from otfload.read.reader import TensorReader
    from otfload.sources.owned import owned

    load_options = resolve_options(options, keywords)
    _, plan, src = plan_model(source, options=load_options)
    with owned(src, source):  # a Source the caller passed in stays open
        info = describe_plan(plan, src.description, plan.config.get("model_type"), plan.family,
                             load_options.scan_layers, reader=TensorReader(src),
                             process=(process_index, process_count), reshard=reshard, platform=platform)
    return info


def load_object(spec: str) -> Any:
    """The object ``MODULE:NAME`` names (``NAME`` may be dotted)."""
    import importlib

    from otfload.errors import MappingError

    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise MappingError(f"{spec!r}: expected MODULE:NAME, e.g. otfload.mappings.linen_llama:TABLE")
    try:
        obj = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise MappingError(f"cannot load {spec!r}: {e}") from e
    return obj


def inspect_custom(source: Any, mapping: str, target: str, mesh: Mesh, **source_options: Any) -> Info:
    """The plan of ``source`` for a model brought by the user (:func:`otfload.plan_params`): ``mapping``
    and ``target`` are ``MODULE:NAME`` specs; the target factory gets ``(config, mesh)`` (or as many
    leading ones as it takes) under ``jax.set_mesh(mesh)``."""
    import inspect as pyinspect

    import jax

    from otfload.api import plan_params
    from otfload.index.checkpoint import open_index
    from otfload.sources.owned import owned_source

    with owned_source(source, **source_options) as src:
        config, description = open_index(src, require_config=False).config, src.description
        table = load_object(mapping)
        table = table(config) if callable(table) else table
        factory = load_object(target)
        takes = len(pyinspect.signature(factory).parameters)
        with jax.set_mesh(mesh):
            abstract = factory(*(config, mesh)[:takes])
        plan = plan_params(src, abstract, table, mesh=mesh)
    return describe_plan(plan, description, config.get("model_type"), f"custom mapping {mapping}", None)


def describe_plan(
    plan: LoadPlan, description: str, model_type: str | None, family: str, scan_layers: bool | None, *,
    reader: TensorReader | None = None, process: tuple[int | None, int | None] = (None, None),
    reshard: str = "auto", platform: str | None = None,
) -> Info:
    """A plan as the JSON-able dict ``otfload inspect`` prints; with ``reader`` (of the plan's
    source), what one process (``process``: index and count, see :func:`process_devices`) fetches.
    Every byte count and total is :mod:`otfload.plan.process_bytes`'s."""
    import jax

    from otfload.plan.leaf_bytes import placed_per_device
    from otfload.plan.process_bytes import process_counts, process_totals
    from otfload.replicated import replicated_by_mesh

    first = next(iter(plan.leaves.values())).leaf.sharding if plan.leaves else None
    mesh = first.mesh if isinstance(first, jax.sharding.NamedSharding) else None  # planned leaves: named
    mesh = mesh if isinstance(mesh, jax.sharding.Mesh) else None  # ... on a concrete mesh
    devices, process_of = process_devices(mesh, *process) if mesh is not None else ([], None)
    held = process_counts(plan, devices)
    summed = process_totals(held.values())
    fetches: dict[str, Info] = {}
    totals: Info = {}
    if reader is not None:
        fetches, totals = process_leaves(plan, reader, devices, process_of, reshard, platform)
        totals = {**totals, "ideal_bytes": summed.ideal} if totals else {}
    leaves = []
    for path, p in plan.leaves.items():
        fetch = fetches.get(path)
        spec = spec_list(getattr(p.placed.sharding, "spec", None))
        leaf = {**p.describe(), "hf_keys": [info.name for info in p.sources], "spec": spec,
                "process_bytes": held[path].needed, "replicated_by_mesh": replicated_by_mesh(p.leaf)}
        if fetch is not None:
            leaf |= {"fetch_bytes": fetch["fetch_bytes"], "requests": fetch["requests"],
                     "ideal_bytes": held[path].ideal, "read_as": fetch["read_as"]}
        leaves.append(leaf | {"shard_bytes": held[path].device})
    return {
        "source": description,
        "model_type": model_type,
        "family": family,
        "mesh": {k: int(v) for k, v in mesh.shape.items()} if mesh is not None else {},
        "devices": mesh.size if mesh is not None else 0,
        "processes": jax.process_count() if process[1] is None else process[1],
        "process_index": jax.process_index() if process[0] is None else process[0],
        "scan_layers": scan_layers,
        "leaves": leaves,
        "unused": list(plan.unused),
        "quantized_kept": {path: {"parts": list(k.parts.values()), "sharding": str(k.spec),
                                  "spec": spec_list(k.spec), "storage": k.storage}
                           for path, k in plan.kept.items()},
        "quantized_notes": dict(plan.kept_notes),
        "placed_bytes_per_device": placed_per_device(p.leaf for p in plan.leaves.values()) if mesh is not None else {},
        "totals": {
            "leaves": len(leaves),
            "hf_tensors": sum(leaf["num_hf_keys"] for leaf in leaves),
            "source_bytes": plan.source_bytes,
            "process_bytes": summed.needed,
            **totals,
            "resharded_leaves": sum(1 for leaf in leaves if leaf.get("read_as")),
            "replicated_by_mesh": sum(1 for leaf in leaves if leaf["replicated_by_mesh"]),
            "device_bytes": summed.device,
        },
    }


def spec_list(spec: Any) -> list[str | list[str] | None] | None:
    """A ``PartitionSpec`` as JSON: one entry per dimension, a mesh axis, a list of them, or None
    (replicated); None for no spec (a sharding that is not named)."""
    if spec is None:
        return None
    return [list(axes) if isinstance(axes, tuple) else axes for axes in spec]


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def model_label(model_type: str | None, family: str) -> str:
    """How ``inspect`` names the model: ``qwen3`` for a supported model_type, whichever family's code
    builds it (that the llama family builds Qwen3 is not the user's concern); a custom mapping, or a
    checkpoint without a model_type, is named with it: ``llama (custom mapping M:TABLE)``."""
    from otfload.families.registry import family_for, supported_model_types

    if model_type is None:
        return family
    if model_type in supported_model_types() and family_for({"model_type": model_type}).name == family:
        return model_type
    return f"{model_type} ({family})"


def format_plan(info: Info) -> str:
    """The human-readable plan."""
    mesh = ", ".join(f"{k}={v}" for k, v in info["mesh"].items())
    lines = [
        f"source       {info['source']}",
        f"model        {model_label(info['model_type'], info['family'])}"
        + ("" if info["scan_layers"] is None else f", scan_layers={info['scan_layers']}"),
        f"mesh         {mesh} ({info['devices']} devices, {info['processes']} process(es))",
        "",
    ]
    for leaf in info["leaves"]:
        keys = " … ".join(dict.fromkeys(leaf["hf_keys"][:1] + leaf["hf_keys"][-1:]))  # the first and the last
        stacked = f" ({leaf['num_hf_keys']} keys, stacked on {', '.join(leaf['stack_axes'])})" \
            if leaf["stack_axes"] else ""
        read = f", fetches {human_bytes(leaf['fetch_bytes'])}" if "fetch_bytes" in leaf else ""
        read += f" as {leaf['read_as']} + reshard" if leaf.get("read_as") else ""
        replicated = "  REPLICATED: the mesh divides none of its dimensions" if leaf.get("replicated_by_mesh") else ""
        lines.append(f"{leaf['leaf']}  {tuple(leaf['shape'])} {leaf['dtype']}  {leaf['sharding']}  "
                     f"{human_bytes(leaf['process_bytes'])}/process{read}{replicated}")
        lines.append(f"    ← {keys}{stacked}  [{leaf['storage']}]")
        if leaf["hooks"]:
            lines.append(f"    hooks: {', '.join(leaf['hooks'])}")
    t = info["totals"]
    lines += [
        "",
        f"{t['leaves']} leaves from {t['hf_tensors']} HF tensors ({human_bytes(t['source_bytes'])}); "
        f"process {info.get('process_index', 0)} needs {human_bytes(t['process_bytes'])}"
        + (f", fetches {human_bytes(t['fetch_bytes'])} in {t['requests']} requests "
           f"({t['fetch_bytes'] / max(1, t['ideal_bytes']):.2f}x its ideal {human_bytes(t['ideal_bytes'])}; "
           f"{t['resharded_leaves']} leaves read as bands and resharded)" if "fetch_bytes" in t else "")
        + f"; largest device shard total {human_bytes(t['device_bytes'])}"
        + (f"; {t['replicated_by_mesh']} leaves replicated: the mesh divides none of their dimensions"
           if t.get("replicated_by_mesh") else ""),
        *_kept_lines(info),
        f"unused tensors ({len(info['unused'])}):" + (" none" if not info["unused"] else ""),
        *(f"    {line}" for line in summarize_names(info["unused"])),
    ]
    return "\n".join(lines)


def _kept_lines(info: Info) -> list[str]:
    """``quantized="keep"``: the leaves placed packed, why others were not, and bytes per device."""
    kept, notes = info.get("quantized_kept", {}), info.get("quantized_notes", {})
    if not kept and not notes:
        return []
    per_device = info.get("placed_bytes_per_device", {})
    lines = [f"kept quantized: {len(kept)} leaves placed packed (codes + scales as stored)"]
    lines += [f"    {path}: {note}" for path, note in notes.items()]
    if per_device:
        lines.append("placed bytes per device: " + ", ".join(f"{d}: {human_bytes(n)}" for d, n in per_device.items()))
    return lines


# Unused-tensor lines printed at most; the rest is counted.
MAX_UNUSED_LINES = 40


def summarize_names(names: list[str], limit: int = MAX_UNUSED_LINES) -> list[str]:
    """Tensor names grouped by their pattern, numbers collapsed into ranges:
    ``model.layers.61.mlp.experts.{0..255}.down_proj.weight (256)``; at most ``limit`` lines."""
    import re

    groups: dict[str, list[tuple[int, ...]]] = {}
    for name in names:
        numbers = tuple(int(n) for n in re.findall(r"(?<=\.)\d+(?=\.|$)", name))
        template = re.sub(r"(?<=\.)\d+(?=\.|$)", "{}", name)
        groups.setdefault(template, []).append(numbers)
    lines = []
    for template, values in groups.items():
        fields = [_ranges(sorted({v[i] for v in values})) for i in range(template.count("{}"))]
        text = template.format(*fields) if fields else template
        lines.append(f"{text} ({len(values)})" if len(values) > 1 else text)
    if len(lines) > limit:
        lines = [*lines[:limit], f"... and {len(lines) - limit} more patterns"]
    return lines


def _ranges(values: list[int]) -> str:
    """``3`` or ``{0..255}`` or ``{1,3,5..9}``."""
    if len(values) == 1:
        return str(values[0])
    parts, start = [], values[0]
    for prev, cur in zip(values, [*values[1:], None], strict=True):
        if cur is None or cur != prev + 1:
            parts.append(str(start) if start == prev else f"{start}..{prev}")
            if cur is not None:
                start = cur
    return "{" + ",".join(parts) + "}"


def format_problems(error: CheckpointMismatchError) -> str:
    lines = [f"the checkpoint does not fit the model: {len(error.problems)} problem(s)"]
    for kind in ("unmapped", "missing", "shape", "unexpected"):
        lines += [f"  {p.describe()}" for p in error.problems if p.kind == kind]
    return "\n".join(lines)


def problems_json(error: CheckpointMismatchError) -> Info:
    fields = ("kind", "hf_key", "leaf", "expected", "actual", "file")
    return {"problems": [{f: _jsonable(getattr(p, f)) for f in fields} for p in error.problems]}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (int, str)):
        return value
    return list(value) if isinstance(value, tuple) else str(value)


def run(args: argparse.Namespace) -> int:
    from otfload.errors import CheckpointMismatchError
    from otfload.options import with_environment

    try:
        if (args.mapping is None) != (args.target is None):
            print("otfload inspect: error: --mapping and --target go together", file=sys.stderr)
            return 2
        options.adapter_as_checkpoint(args)
        load_options = options.load_options(args)
        if args.mapping is not None:
            assert load_options.mesh is not None  # load_options makes --mesh a Mesh
            info = inspect_custom(args.source, args.mapping, args.target, load_options.mesh,
                                  **load_options.source_options())
        else:
            reshard = with_environment(load_options).reshard or "auto"  # --reshard, else $OTFLOAD_RESHARD
            info = inspect_source(args.source, process_index=args.process_index, process_count=args.process_count,
                                  reshard=reshard, platform=args.platform, options=load_options)
    except CheckpointMismatchError as e:
        print(json.dumps(problems_json(e), indent=1) if args.json else format_problems(e))
        return 1
    print(json.dumps(info, indent=1) if args.json else format_plan(info))
    return 0
