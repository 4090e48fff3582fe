"""Meshes and logical-axis rules: from a leaf's logical axis names to its ``NamedSharding``.

A model annotates each parameter with logical axis names (``("embed", "heads", "head_dim")``);
rules map each logical name to one mesh axis, several mesh axes, or ``None`` (replicated). A rule
is skipped for a dimension when its mesh axes are missing from the mesh, already used by an earlier
dimension of the same leaf, or do not divide the dimension — the dimension is then replicated, so
any rule set works on any mesh.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.errors import DeviceCountError, MappingError, OtfloadError

LogicalRules = Sequence[tuple[str, str | tuple[str, ...] | None]]

# Default rules for decoder LMs: fully-sharded data parallel on "fsdp", tensor parallel on "tp",
# experts on "ep". Layer (scan) axes are never sharded: scan slices them one at a time.
DEFAULT_RULES: LogicalRules = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("heads", "tp"),
    ("kv_heads", "tp"),
    ("head_dim", None),
    ("mlp", "tp"),
    ("experts", "ep"),
    ("layers", None),
    ("norm", None),
)


def parse_mesh_spec(spec: str) -> dict[str, int]:
    """Parse ``"fsdp=4,tp=2"`` into ``{"fsdp": 4, "tp": 2}`` (order kept)."""
    axes: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, sep, size = part.partition("=")
        if not sep or not name.strip() or not size.strip().lstrip("-").isdigit():
            raise OtfloadError(f"bad mesh spec {spec!r}: expected NAME=SIZE[,NAME=SIZE...], got {part!r}")
        if name.strip() in axes:
            raise OtfloadError(f"bad mesh spec {spec!r}: axis {name.strip()!r} given twice")
        axes[name.strip()] = int(size)
    if not axes:
        raise OtfloadError(f"bad mesh spec {spec!r}: no axes")
    return axes


def make_mesh(axes: Mapping[str, int] | str | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh`` with Auto axis types; ``None`` puts every device on one ``fsdp`` axis.

    One axis size may be ``-1`` and is then inferred from the device count.
    """
    devices = list(jax.devices() if devices is None else devices)
    if axes is None:
        axes = {"fsdp": len(devices)}
    elif isinstance(axes, str):
        axes = parse_mesh_spec(axes)
    sizes = dict(axes)
    unknown = [k for k, v in sizes.items() if v == -1]
    known = int(np.prod([v for v in sizes.values() if v != -1]))
    if len(unknown) > 1 or known <= 0:
        raise OtfloadError(f"mesh {dict(axes)}: at most one axis may be -1 and sizes must be positive")
    if unknown:
        sizes[unknown[0]] = len(devices) // known
    total = int(np.prod(list(sizes.values())))
    if total != len(devices):
        raise DeviceCountError(sizes, len(devices))
    grid = np.array(devices, dtype=object).reshape(tuple(sizes.values()))
    return Mesh(grid, tuple(sizes.keys()))


def logical_to_spec(
    logical_axes: Iterable[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh,
    rules: LogicalRules = DEFAULT_RULES,
) -> PartitionSpec:
    """The ``PartitionSpec`` for a leaf of ``shape`` whose dimensions carry ``logical_axes``."""
    if logical_axes is None:
        return PartitionSpec()  # type: ignore[no-untyped-call]  # jax: unannotated __init__
    table = dict(rules)
    used: set[str] = set()
    spec: list[str | tuple[str, ...] | None] = []
    for dim, name in zip(shape, logical_axes, strict=True):
        target = table.get(name) if name is not None else None
        mesh_axes = (target,) if isinstance(target, str) else tuple(target or ())
        mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and a not in used)
        size = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
        if not mesh_axes or size == 1 or dim % size != 0:
            spec.append(None)
            continue
        used.update(mesh_axes)
        spec.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)  # type: ignore[no-untyped-call]  # as above


def logical_to_sharding(
    logical_axes: Iterable[str | None] | None,
    shape: Sequence[int],
    mesh: Mesh,
    rules: LogicalRules = DEFAULT_RULES,
) -> NamedSharding:
    """The ``NamedSharding`` for a leaf; see :func:`logical_to_spec`."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, shape, mesh, rules))


def transposed_sharding(sharding: jax.sharding.Sharding, order: Sequence[int]) -> jax.sharding.Sharding:
    """``sharding`` of a leaf seen with its dimensions reordered (dimension ``j`` of the result is
    dimension ``order[j]`` of the leaf): every device keeps the same elements. A named sharding's
    spec is permuted; a fully replicated one is its own; any other cannot be reordered here."""
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (len(order) - len(sharding.spec))
        permuted = PartitionSpec(*(spec[d] for d in order))  # type: ignore[no-untyped-call]  # as above
        return NamedSharding(sharding.mesh, permuted, memory_kind=sharding.memory_kind)
    if sharding.is_fully_replicated:
        return sharding
    raise MappingError(f"a leaf whose stack axes do not lead needs a NamedSharding or a replicated one, not {sharding}")
