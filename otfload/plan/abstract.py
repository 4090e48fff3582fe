"""The abstract target: every parameter leaf's path, shape, dtype and ``Sharding``, with no weight
allocated.

Three kinds of target come in (:func:`abstract_target`), and a load gives back the same kind:

* an abstract ``nnx.Module`` (``nnx.eval_shape(lambda: Model(...))``), or the function that builds
  the module (``lambda: Model(...)``, traced by :func:`~otfload.plan.eval_shape.abstract_module`,
  several times faster than ``nnx.eval_shape`` on JAX ≤ 0.10): its ``nnx.Param`` s are the leaves and
  the module itself comes back, ready;
* an ``nnx.State`` (``nnx.state(model)``, the state of ``nnx.split`` or ``nnx.get_abstract_model``):
  an ``nnx.State`` comes back with arrays in its ``nnx.Param`` s;
* any pytree of ``jax.ShapeDtypeStruct`` (Linen, Equinox, MaxText, plain dicts): the same tree
  comes back with ``jax.Array`` leaves.

A leaf's sharding is, in order: the sharding its value already carries (an abstract mesh made
concrete on ``mesh``); else the names in its metadata (Flax ≥ 0.12 keeps them in ``out_sharding``;
older ``sharding_names``/``sharding``; otfload's models ``logical_axes``) — mesh axis names are used
as they are, logical names go through the rules; else replicated on ``mesh``. Leaf paths are dotted
strings (``layers.attn.q.kernel``, never ending in ``.value``) — what mapping tables match.

Every problem is a typed error here, at plan time: a sharding on an abstract mesh (or none) with no
``mesh`` (:class:`~otfload.errors.MeshRequiredError`), a sharding that does not divide its dimension
(:class:`~otfload.errors.IndivisibleShardingError`), and a leaf no rule maps
(:func:`unmapped_problems`, problems of kind ``unmapped`` naming the nearest rules).
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, TypeVar

import jax
import numpy as np
from flax import nnx
from flax.typing import PathParts
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec, Sharding

from otfload.errors import IndivisibleShardingError, MappingError, MeshRequiredError, TensorProblem
from otfload.plan.eval_shape import abstract_module
from otfload.plan.mapping import MappingTable
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, logical_to_sharding, logical_to_spec

# Nearest rules an unmapped leaf's error names, and how alike (difflib ratio) a rule must be to count.
NEAREST_RULES = 3
NEAREST_CUTOFF = 0.4
S = TypeVar("S", bound=Sharding)
# Metadata keys that hold a Variable's sharding names, in the order they are looked for.
SHARDING_METADATA = ("out_sharding", "sharding_names", "sharding", "logical_axes")


class AbstractLeaf(NamedTuple):
    """One target leaf: what it must look like once loaded."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    logical_axes: tuple[str | None, ...] | None = None


def dotted(path: Iterable[Any]) -> str:
    """A pytree/NNX path as a dotted string."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    return ".".join(parts)


def _axes_of(variable: nnx.Variable[Any]) -> tuple[str | None, ...] | None:
    meta = variable.get_metadata()
    for name in ("logical_axes", "sharding_names", "sharding", "out_sharding"):
        axes = meta.get(name)
        if axes is not None and not isinstance(axes, Sharding | PartitionSpec):
            return tuple(axes)
    return None


def abstract_from_nnx(
    model: nnx.Module, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES
) -> dict[str, AbstractLeaf]:
    """Abstract leaves of an otfload NNX model's ``nnx.Param`` s, whose logical axis names go
    through ``rules`` (an axis a rule cannot shard is replicated); see :func:`abstract_target` for
    models brought by users."""
    leaves = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        axes = _axes_of(variable)
        shape = tuple(value.shape)
        sharding = logical_to_sharding(axes, shape, mesh, rules)
        key = dotted(path)
        leaves[key] = AbstractLeaf(key, shape, np.dtype(value.dtype), sharding, axes)
    return leaves


# --- shardings -------------------------------------------------------------------------------------


def _mesh_axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def check_divisible(path: str, shape: Sequence[int], sharding: S) -> S:
    """``sharding`` if it fits a leaf of ``shape``; else a typed error naming leaf, axis and sizes."""
    if not isinstance(sharding, NamedSharding):
        try:
            sharding.shard_shape(tuple(shape))
        except Exception as e:  # noqa: BLE001 - JAX raises several types; all mean "does not fit"
            raise MappingError(f"leaf {path!r}: sharding {sharding} does not fit shape {tuple(shape)}: {e}") from e
        return sharding
    spec, mesh = sharding.spec, sharding.mesh
    if len(spec) > len(shape):
        raise MappingError(f"leaf {path!r}: sharding {spec} has {len(spec)} entries for leaf shape {tuple(shape)}")
    for dim, entry in enumerate(spec):
        axes = _mesh_axes(entry)
        unknown = [a for a in axes if a not in mesh.shape]
        if unknown:
            raise MappingError(f"leaf {path!r}: sharding {spec} names axes {unknown} not in mesh {dict(mesh.shape)}")
        size = math.prod(mesh.shape[a] for a in axes)
        if shape[dim] % size:
            raise IndivisibleShardingError(path, dim, int(shape[dim]), axes, size)
    return sharding


def _on_mesh(path: str, sharding: NamedSharding, mesh: Mesh | None) -> NamedSharding:
    """``sharding`` itself on a concrete mesh; on an abstract one, the same spec on ``mesh``."""
    if not isinstance(sharding.mesh, AbstractMesh):
        return sharding
    if mesh is None:
        raise MeshRequiredError(
            f"leaf {path!r} is sharded {sharding.spec} on an abstract mesh {dict(sharding.mesh.shape)} "
            "(nnx.eval_shape under jax.set_mesh gives those): pass mesh= to make it concrete"
        )
    if dict(sharding.mesh.shape) != dict(mesh.shape):
        raise MeshRequiredError(
            f"leaf {path!r} is sharded on a mesh {dict(sharding.mesh.shape)} unlike mesh= {dict(mesh.shape)}"
        )
    return NamedSharding(mesh, sharding.spec)


def _is_explicit(names: Sequence[Any], mesh: Mesh, rules: LogicalRules) -> bool:
    """True when every name is a mesh axis (or a tuple of them) that no rule renames."""
    logical = {name for name, _ in rules}
    flat = [a for entry in names for a in _mesh_axes(entry)]
    return all(a in mesh.shape and a not in logical for a in flat)


def sharding_from_names(
    path: str, names: Sequence[Any], shape: Sequence[int], mesh: Mesh, rules: LogicalRules
) -> NamedSharding:
    """The sharding that metadata names describe: mesh axis names as they are (a dimension they do
    not divide is an error), logical names through ``rules`` (a dimension a rule cannot divide is
    replicated, as for otfload's own models); a name that is neither is an error. No names (``()``,
    as ``PartitionSpec()``) replicate the leaf."""
    names = tuple(names)
    if not names:  # ``out_sharding=()``: P(), every dimension replicated
        return NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]  # jax: unannotated __init__
    if len(names) != len(shape):
        raise MappingError(f"leaf {path!r}: {len(names)} sharding names {names} for leaf shape {tuple(shape)}")
    if _is_explicit(names, mesh, rules):
        spec = PartitionSpec(*names)  # type: ignore[no-untyped-call]  # jax: unannotated __init__
        return check_divisible(path, shape, NamedSharding(mesh, spec))
    known = {name for name, _ in rules}
    unknown = [n for n in names if n is not None and not (isinstance(n, str) and (n in known or n in mesh.shape))]
    if unknown:
        raise MappingError(
            f"leaf {path!r}: sharding names {unknown} are neither mesh axes {tuple(mesh.shape)} nor logical axes "
            "of the rules; pass rules= with a (name, mesh axis or None) pair for each"
        )
    identity = tuple((axis, axis) for axis in mesh.shape if axis not in known)
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, (*rules, *identity)))


def _context_mesh() -> Mesh | None:
    """The concrete mesh of an enclosing ``jax.set_mesh``, if any."""
    try:
        mesh = jax.sharding.get_mesh()
    except Exception:  # noqa: BLE001 - no mesh context
        return None
    return mesh if isinstance(mesh, Mesh) and not mesh.empty else None


def _rules_for(metadata: Mapping[str, Any], rules: LogicalRules | None) -> LogicalRules:
    """A variable's own ``sharding_rules`` first, then ``rules`` (else Flax's context rules, else
    otfload's defaults)."""
    if rules is None:
        from flax.core import spmd

        rules = tuple(spmd.get_logical_axis_rules()) or DEFAULT_RULES
    return (*tuple(metadata.get("sharding_rules") or ()), *rules)


def leaf_sharding(
    path: str,
    shape: Sequence[int],
    value_sharding: Sharding | None,
    metadata: Mapping[str, Any],
    mesh: Mesh | None,
    rules: LogicalRules | None,
) -> tuple[Sharding, tuple[Any, ...] | None]:
    """One leaf's concrete sharding (checked against its shape) and the names it came from."""
    names = next((metadata[k] for k in SHARDING_METADATA if metadata.get(k) is not None), None)
    if isinstance(value_sharding, NamedSharding):
        return check_divisible(path, shape, _on_mesh(path, value_sharding, mesh)), None
    if value_sharding is not None:
        return check_divisible(path, shape, value_sharding), None
    if isinstance(names, NamedSharding):
        return check_divisible(path, shape, _on_mesh(path, names, mesh)), None
    if names is not None:
        if mesh is None:
            raise MeshRequiredError(f"leaf {path!r} has sharding names {names} but no mesh: pass mesh=")
        if isinstance(names, PartitionSpec):
            return check_divisible(path, shape, NamedSharding(mesh, names)), None
        return sharding_from_names(path, names, shape, mesh, _rules_for(metadata, rules)), tuple(names)
    if mesh is None:
        raise MeshRequiredError(f"leaf {path!r} has no sharding and no mesh was given: pass mesh=")
    return NamedSharding(mesh, PartitionSpec()), None  # type: ignore[no-untyped-call]  # jax: unannotated __init__


def _leaf(
    path: str, value: Any, metadata: Mapping[str, Any], mesh: Mesh | None, rules: LogicalRules | None
) -> AbstractLeaf:
    shape = tuple(int(d) for d in value.shape)
    sharding, names = leaf_sharding(path, shape, getattr(value, "sharding", None), metadata, mesh, rules)
    return AbstractLeaf(path, shape, np.dtype(value.dtype), sharding, names)


# --- targets ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A target flattened into leaves, and how to give the loaded arrays back in its own kind."""

    kind: str  # "module" | "state" | "pytree"
    leaves: dict[str, AbstractLeaf]
    rebuild: Callable[[Mapping[str, jax.Array]], Any]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


# A flattened ``nnx.State``: (path, variable or value) pairs.
FlatPairs = list[tuple[PathParts, Any]]


def _from_state(
    state: nnx.State[Any, Any], mesh: Mesh | None, rules: LogicalRules | None
) -> tuple[FlatPairs, dict[str, AbstractLeaf]]:
    flat = list(nnx.to_flat_state(state))
    leaves = {}
    for path, var in flat:
        if isinstance(var, nnx.Param):
            key = dotted(path)
            leaves[key] = _leaf(key, var.get_value(), var.get_metadata(), mesh, rules)
    return flat, leaves


def _filled(flat: FlatPairs, arrays: Mapping[str, jax.Array]) -> nnx.State[Any, Any]:
    """The state of ``flat`` with every loaded ``nnx.Param`` holding its array."""
    pairs = [(p, v.replace(arrays[dotted(p)]) if isinstance(v, nnx.Param) else v) for p, v in flat]
    return nnx.from_flat_state(pairs)


def abstract_target(target: Any, mesh: Mesh | None = None, rules: LogicalRules | None = None) -> Target:
    """Flatten an abstract ``nnx.Module``, an ``nnx.State`` or a pytree of ``ShapeDtypeStruct``
    (``nnx.Variable`` leaves allowed) — or a function without arguments that builds one of them (run
    under ``jax.set_mesh(mesh)``) — into leaves with concrete, checked shardings.

    ``mesh`` (default: the mesh of an enclosing ``jax.set_mesh``) makes abstract-mesh shardings and
    sharding names concrete; ``rules`` (default: Flax's ``logical_axis_rules`` context, else
    :data:`~otfload.plan.sharding.DEFAULT_RULES`) map logical names to mesh axes.
    """
    mesh = mesh if mesh is not None else _context_mesh()
    if _is_factory(target):
        with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
            target = abstract_module(target)
    if isinstance(target, nnx.Module):
        flat, leaves = _from_state(nnx.state(target), mesh, rules)

        def rebuild_module(arrays: Mapping[str, jax.Array]) -> nnx.Module:
            nnx.update(target, _filled(flat, arrays))
            return target

        return Target("module", leaves, rebuild_module)
    if isinstance(target, nnx.State):
        flat, leaves = _from_state(target, mesh, rules)
        return Target("state", leaves, lambda arrays: _filled(flat, arrays))
    pairs, treedef = jax.tree_util.tree_flatten_with_path(target, is_leaf=_is_variable)
    leaves, keys = {}, []
    for path, leaf in pairs:
        key = dotted(path)
        if isinstance(leaf, nnx.Variable):
            leaves[key] = _leaf(key, leaf.get_value(), leaf.get_metadata(), mesh, rules)
        else:
            leaves[key] = _leaf(key, leaf, {}, mesh, rules)
        keys.append(key)

    def rebuild_tree(arrays: Mapping[str, jax.Array]) -> Any:
        out = [leaf.replace(arrays[k]) if isinstance(leaf, nnx.Variable) else arrays[k]
               for k, (_, leaf) in zip(keys, pairs, strict=True)]
        return jax.tree_util.tree_unflatten(treedef, out)

    return Target("pytree", leaves, rebuild_tree)


def _is_factory(target: Any) -> bool:
    """True for a function that builds the target (a module is callable too, but is the target)."""
    return callable(target) and not isinstance(target, (nnx.Module, nnx.State, nnx.Variable))


def abstract_from_pytree(tree: Any, mesh: Mesh | None = None) -> tuple[dict[str, AbstractLeaf], Any]:
    """Abstract leaves of a pytree of ``ShapeDtypeStruct`` (or arrays); returns them and the treedef.

    A leaf without a sharding is replicated on ``mesh`` (which is then required).
    """
    _, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_variable)
    return abstract_target(tree, mesh).leaves, treedef


# --- mapping coverage ------------------------------------------------------------------------------


def nearest_rules(path: str, table: MappingTable, n: int = NEAREST_RULES) -> list[str]:
    """The target templates of ``table`` most like ``path`` (difflib), best first."""
    templates = list(dict.fromkeys(r.target for r in table.rules))
    return difflib.get_close_matches(path, templates, n=n, cutoff=NEAREST_CUTOFF)


def unmapped_problems(leaves: Mapping[str, AbstractLeaf], table: MappingTable) -> list[TensorProblem]:
    """A problem of kind ``unmapped`` for every leaf no rule of ``table`` matches; ``actual`` lists
    the nearest rules."""
    return [
        TensorProblem("unmapped", None, path, expected=leaf.shape, actual=nearest_rules(path, table))
        for path, leaf in leaves.items()
        if table.find(path) is None
    ]
