"""Dotted leaf paths for nested parameter trees (``"model.layers.0.mlp.kernel"``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax


def _key_name(entry: Any) -> str:
    for attr in ("key", "idx", "name"):  # DictKey, SequenceKey, GetAttrKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten_tree(tree: Any) -> dict[str, Any]:
    """``{dotted path: leaf}`` for every leaf of ``tree`` (``None`` leaves are dropped)."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {".".join(_key_name(k) for k in path): leaf for path, leaf in leaves}


def unflatten_tree(flat: Mapping[str, Any]) -> dict[str, Any]:
    """The nested dict whose dotted leaf paths are the keys of ``flat``."""
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        *parents, name = path.split(".")
        node = root
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = leaf
    return root
