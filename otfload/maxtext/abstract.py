"""MaxText's parameter tree as ``jax.ShapeDtypeStruct`` s, built from its config without MaxText:
what ``nnx.state(model, nnx.Param).to_pure_dict()`` of MaxText's abstract model holds, for the
models :mod:`otfload.maxtext` has tables for. A MaxText run passes its own abstract state to
:func:`~otfload.maxtext.load_state`; this tree is for tools, tests and examples without MaxText.

Shardings follow MaxText's default logical rules on a ``fsdp`` x ``tensor`` mesh (embedding
dimension over ``fsdp``; heads, MLP and vocabulary over ``tensor``; layers and experts whole); a
mesh without one of those axes leaves that dimension whole.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.maxtext.selection import Selection, select
from otfload.maxtext.tables import EXPERTS, LOGITS, Leaf, slice_shape
from otfload.plan.mapping import stack_dims


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": x}`` → ``{"a": {"b": x}}``."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, name = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def leaf_layouts(selection: Selection) -> dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]:
    """Every leaf path → (shape, mesh axis per dimension) of the tree ``selection`` describes."""
    config = selection.hook_config({"hf_vocab_size": selection.fields["vocab_size"]})
    out: dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]] = {}
    for leaf in selection.table.top:
        if leaf.path == LOGITS and selection.logits_via_embedding:
            continue
        out[leaf.path] = (slice_shape(leaf, config), leaf.axes)
    table = selection.mapping
    for group in selection.groups:
        template = group.prefix(selection.scan_layers)
        layers, sizes = group.path_layers(config), group.stack_sizes(config)
        # a group of single layers in a scanned tree too: Gemma 3's decoder.layers_remainder.layers_<r>
        prefixes = [template.format(layer=i) for i in layers] if "{layer}" in template else [template]
        for prefix in prefixes if layers else ():
            for leaf in group.leaves:
                out[f"{prefix}.{leaf.path}"] = _stacked(table.find(f"{prefix}.{leaf.path}"), leaf, config, sizes)
    for extra in selection.table.extras:
        for leaf, path in zip(extra.leaves, extra.paths(), strict=True) if selection.fields[extra.field] else ():
            out[path] = _stacked(table.find(path), leaf, config, {"layer": 1})
    return out


def _stacked(found: Any, leaf: Leaf, config: Mapping[str, Any],
             sizes: Mapping[str, int]) -> tuple[tuple[int, ...], tuple[str | None, ...]]:
    rule, _, axes = found
    shape: list[int] = list(slice_shape(leaf, config))
    names: list[str | None] = list(leaf.axes)
    ndim = len(shape) + len(axes)
    placed = dict(zip(stack_dims(rule, axes, ndim, config), axes, strict=True))
    for dim in sorted(placed):
        name = placed[dim]
        shape.insert(dim, sizes[name] if name in sizes else int(config[EXPERTS]))
        names.insert(dim, None)
    return tuple(shape), tuple(names)


def abstract_params(maxtext_config: Any, mesh: Mesh | None = None, dtype: Any = np.float32) -> dict[str, Any]:
    """The MaxText tree ``maxtext_config`` describes (its ``model_name``, ``scan_layers``,
    ``param_scan_axis`` and dimensions), sharded on ``mesh`` when one is given."""
    selection = select(maxtext_config)

    def leaf(shape: tuple[int, ...], axes: tuple[str | None, ...]) -> jax.ShapeDtypeStruct:
        sharding = None
        if mesh is not None:
            spec = PartitionSpec(*(a if a in mesh.axis_names else None for a in axes))  # type: ignore[no-untyped-call]
            sharding = NamedSharding(mesh, spec)
        # the ignore: jax's ShapeDtypeStruct.__init__ is unannotated
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)  # type: ignore[no-untyped-call]

    return nest({path: leaf(*layout) for path, layout in leaf_layouts(selection).items()})
