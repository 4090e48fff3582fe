"""Layout metadata recorded with every native checkpoint, and the ``scan_layers`` rule for reading one.

Rule (applied wherever a checkpoint is read: restore, reshard, export): if the caller did not set
``scan_layers``, adopt the saved value; if the caller set a conflicting value, raise
:class:`~otfload.errors.ScanLayersMismatchError` naming both; if the checkpoint has no metadata, use
the caller's value and warn.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from otfload.checkpoint.layout import detect_scan_layers
from otfload.checkpoint.paths import flatten_tree
from otfload.errors import NativeCheckpointError, ScanLayersMismatchError


class MissingLayoutMetadataWarning(UserWarning):
    """A checkpoint has no otfload layout metadata; the caller's ``scan_layers`` is used unchecked."""


def otfload_version() -> str:
    """The installed otfload version, or ``"0+unknown"`` when running from a source tree."""
    try:
        return importlib.metadata.version("otfload")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


@dataclass(frozen=True)
class LayoutMetadata:
    """How the parameters of a native checkpoint are laid out.

    ``logical_axes`` maps a dotted leaf path to the logical axis name of each dimension; resharding
    uses it to place the leaf on a new mesh.
    """

    scan_layers: bool | None = None
    family: str | None = None
    model_type: str | None = None
    hf_config: dict[str, Any] = field(default_factory=dict)
    param_dtype: str | None = None
    mesh_axes: dict[str, int] = field(default_factory=dict)
    logical_axes: dict[str, tuple[str | None, ...]] = field(default_factory=dict)
    otfload_version: str = field(default_factory=otfload_version)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        out = dataclasses.asdict(self)
        out["logical_axes"] = {k: list(v) for k, v in self.logical_axes.items()}
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LayoutMetadata:
        """Inverse of :meth:`to_json`; unknown keys (from newer versions) are ignored."""
        if not isinstance(data, Mapping):
            raise NativeCheckpointError(f"layout metadata must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if not isinstance(kwargs.get("scan_layers"), bool | None):
            raise NativeCheckpointError(f"layout metadata: scan_layers={kwargs['scan_layers']!r} is no bool")
        kwargs["logical_axes"] = {k: tuple(v) for k, v in kwargs.get("logical_axes", {}).items()}
        return cls(**kwargs)

    def replace(self, **changes: Any) -> LayoutMetadata:
        """A copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def completed_for(self, state: Any, layer_key: str = "layers") -> LayoutMetadata:
        """Fill unset ``scan_layers``, ``param_dtype`` and ``mesh_axes`` from the tree being saved."""
        flat = flatten_tree(state)
        changes: dict[str, Any] = {}
        if self.scan_layers is None:
            changes["scan_layers"] = bool(detect_scan_layers(flat, layer_key))  # no layers: not scanned
        dtypes = {str(np.dtype(leaf.dtype)) for leaf in flat.values() if hasattr(leaf, "dtype")}
        if self.param_dtype is None and len(dtypes) == 1:
            changes["param_dtype"] = dtypes.pop()
        mesh = next((_mesh_of(leaf) for leaf in flat.values() if _mesh_of(leaf) is not None), None)
        if not self.mesh_axes and mesh is not None:
            changes["mesh_axes"] = mesh_axes_of(mesh)
        return self.replace(**changes)


def mesh_axes_of(mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh) -> dict[str, int]:
    """``{axis name: size}`` of ``mesh``, in mesh order."""
    return {str(name): int(size) for name, size in mesh.shape.items()}


def _mesh_of(leaf: Any) -> jax.sharding.Mesh | jax.sharding.AbstractMesh | None:
    sharding = getattr(leaf, "sharding", None)
    return sharding.mesh if isinstance(sharding, jax.sharding.NamedSharding) else None


def resolve_scan_layers(
    requested: bool | None, saved: bool | None, *, source: str = "checkpoint", default: bool = False
) -> bool:
    """The ``scan_layers`` value to read a checkpoint with; see the module docstring for the rule.

    ``source`` names the checkpoint in messages; ``default`` is used when neither value is known.
    """
    if saved is None:
        value = default if requested is None else requested
        warnings.warn(
            f"{source} records no scan_layers metadata; assuming scan_layers={value}",
            MissingLayoutMetadataWarning,
            stacklevel=2,
        )
        return value
    if requested is None or requested == saved:
        return saved
    raise ScanLayersMismatchError(
        f"scan_layers={requested} was requested, but {source} was saved with scan_layers={saved}; "
        "leave scan_layers unset to adopt the saved value, or convert the checkpoint with "
        "otfload.checkpoint.stack_layers / unstack_layers"
    )
