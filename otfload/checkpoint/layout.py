"""Explicit conversion between the scanned and unscanned layer layouts of a flat parameter dict.

In the otfload convention an *unscanned* tree holds one subtree per layer at
``<prefix>.layers.<i>.<rest>``; a *scanned* tree holds one leaf per ``<prefix>.layers.<rest>`` whose
leading axis has size ``L`` (the layer count). Keys may be dotted strings or path tuples; the output
uses the same style (layer indices are ``str`` in dotted keys and ``int`` in tuple keys).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from otfload.errors import LayerLayoutError

Key = str | tuple[Hashable, ...]


class _LayerPath(NamedTuple):
    prefix: tuple[Hashable, ...]  # up to and including the layer key
    layer: int | None  # layer index (unscanned) or None (scanned)
    rest: tuple[Hashable, ...]


def _parts(key: Key) -> tuple[Hashable, ...]:
    return tuple(key.split(".")) if isinstance(key, str) else tuple(key)


def _make_key(parts: Iterable[Hashable], like: Key) -> Key:
    return ".".join(map(str, parts)) if isinstance(like, str) else tuple(parts)


def _as_index(part: Hashable) -> int | None:
    if isinstance(part, int) and not isinstance(part, bool):
        return part
    return int(part) if isinstance(part, str) and part.isdigit() else None


def _layer_path(key: Key, layer_key: str) -> _LayerPath | None:
    parts = _parts(key)
    if layer_key not in parts:
        return None
    j = parts.index(layer_key) + 1
    index = _as_index(parts[j]) if j < len(parts) else None
    rest = parts[j + 1 :] if index is not None else parts[j:]
    return _LayerPath(parts[:j], index, rest)


def detect_scan_layers(keys: Iterable[Key], layer_key: str = "layers") -> bool | None:
    """``True`` for a scanned tree, ``False`` for an unscanned one, ``None`` if it has no layers."""
    found = {p.layer is None for k in keys if (p := _layer_path(k, layer_key)) is not None}
    if len(found) > 1:
        raise LayerLayoutError(f"tree mixes scanned and unscanned {layer_key!r} subtrees")
    return found.pop() if found else None


def _put(out: dict[Key, Any], key: Key, value: Any) -> None:
    if key in out:
        raise LayerLayoutError(f"converted key {key!r} collides with an existing key")
    out[key] = value


def stack_layers(flat: Mapping[Key, Any], layer_key: str = "layers") -> dict[Key, Any]:
    """Unscanned -> scanned: stack ``...layers.<i>.rest`` into ``...layers.rest`` (one stack per leaf)."""
    out: dict[Key, Any] = {}
    groups: dict[tuple[tuple[Hashable, ...], tuple[Hashable, ...]], dict[int, tuple[Key, Any]]] = {}
    for key, value in flat.items():
        path = _layer_path(key, layer_key)
        if path is None or path.layer is None:
            _put(out, key, value)
        else:
            groups.setdefault((path.prefix, path.rest), {})[path.layer] = (key, value)
    counts: dict[tuple[Hashable, ...], int] = {}
    for (prefix, rest), by_index in groups.items():
        n = counts.setdefault(prefix, max(by_index) + 1)
        if sorted(by_index) != list(range(n)):
            name = _make_key(prefix + rest, next(iter(by_index.values()))[0])
            raise LayerLayoutError(
                f"{name!r}: layers {sorted(by_index)} present, expected 0..{n - 1} like the other leaves"
            )
        keys, values = zip(*(by_index[i] for i in range(n)), strict=True)
        stack = jnp.stack if any(isinstance(v, jax.Array) for v in values) else np.stack
        _put(out, _make_key(prefix + rest, keys[0]), stack(values))
    return out


def unstack_layers(flat: Mapping[Key, Any], layer_key: str = "layers") -> dict[Key, Any]:
    """Scanned -> unscanned: split each ``...layers.rest`` along axis 0 into ``...layers.<i>.rest``."""
    out: dict[Key, Any] = {}
    for key, value in flat.items():
        path = _layer_path(key, layer_key)
        if path is None or path.layer is not None:
            _put(out, key, value)
            continue
        if np.ndim(value) == 0:
            raise LayerLayoutError(f"{key!r} is scanned but has no leading layer axis")
        slices = jnp.unstack(value) if isinstance(value, jax.Array) else list(value)
        for i, piece in enumerate(slices):
            index = i if isinstance(key, tuple) else str(i)
            _put(out, _make_key((*path.prefix, index, *path.rest), key), piece)
    return out
