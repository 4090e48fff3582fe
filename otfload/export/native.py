"""Export a native (Orbax) checkpoint to HF safetensors without loading the model.

The model family and ``config.json`` come from the checkpoint's
:class:`~otfload.checkpoint.LayoutMetadata`, its ``scan_layers`` is resolved with the usual rule
(:func:`~otfload.checkpoint.resolve_scan_layers`), and the leaves are restored one at a time
(leaves that slice one HF tensor together, such as GPT-OSS gate/up, are restored together) onto
the host. The shard files are laid out first so that each tensor is written as soon as its leaf
is restored: host memory holds one leaf, never the model.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax

from otfload.atomic import atomic_dir
from otfload.errors import MappingError, NativeCheckpointError, ScanLayersMismatchError
from otfload.export.api import load_config
from otfload.export.gather import gather_slice
from otfload.export.job import ExportJob
from otfload.export.writer import ShardFiles, write_config, write_progress
from otfload.index.checkpoint import CONFIG_FILE

if TYPE_CHECKING:  # otfload.checkpoint imports Orbax: only when a native checkpoint is exported
    from otfload.checkpoint import LayoutMetadata, OrbaxCheckpointManager


def _open(path: str | os.PathLike[str]) -> OrbaxCheckpointManager:
    from otfload.checkpoint import CheckpointConfig, OrbaxCheckpointManager

    return OrbaxCheckpointManager(CheckpointConfig(path, max_to_keep=None, async_save=False))


def is_native_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a local directory of committed Orbax steps (not an HF checkpoint)."""
    path = Path(path)
    if not path.is_dir() or (path / CONFIG_FILE).exists() or not any(p.name.isdigit() for p in path.iterdir()):
        return False
    with _open(path) as manager:
        return manager.has_checkpoint()


def _hf_config(
    layout: LayoutMetadata | None, config: Mapping[str, Any] | str | os.PathLike[str] | None, where: str
) -> dict[str, Any]:
    if config is not None:
        return load_config(config)
    if layout is None or not layout.hf_config:
        raise MappingError(f"{where} records no HF config; pass config= (dict or config.json path)")
    if layout.model_type is None:
        return dict(layout.hf_config)
    return {"model_type": layout.model_type, **layout.hf_config}


def _groups(job: ExportJob) -> list[tuple[set[str], list[str]]]:
    """``(leaves, HF keys)`` in file order: every key built from the leaves, leaves sharing a key together."""
    parent: dict[str, str] = {}

    def root(leaf: str) -> str:
        while parent.setdefault(leaf, leaf) != leaf:
            leaf = parent[leaf]
        return leaf

    for tensor in job.plan.tensors.values():
        first, *rest = (leaf for leaf, _ in tensor.sources)
        for leaf in rest:
            parent[root(leaf)] = root(first)
    groups: dict[str, tuple[set[str], list[str]]] = {}
    for spec in job.specs:
        sources = job.plan.tensors[spec.key].sources
        leaves, keys = groups.setdefault(root(sources[0][0]), (set(), []))
        leaves.update(leaf for leaf, _ in sources)
        keys.append(spec.key)
    return list(groups.values())


def export_native(
    checkpoint_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    step: int | None = None,
    scan_layers: bool | None = None,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Write ``step`` (default: the latest) of the native checkpoint ``checkpoint_dir`` to ``out_dir``
    as an HF safetensors checkpoint; returns the path.

    ``scan_layers`` is checked against the saved metadata: ``None`` adopts it, a conflicting value
    raises :class:`~otfload.errors.ScanLayersMismatchError`, and without metadata the value (default:
    the saved tree's own layout) is used with a :class:`~otfload.checkpoint.MissingLayoutMetadataWarning`.
    ``config`` (an HF ``config.json`` dict or path) replaces the one recorded in the metadata (needed
    for a checkpoint without it). ``dtype``, ``max_shard_size``, ``overwrite`` and ``progress`` are as in
    :func:`~otfload.export.export_hf`; HF shapes are inferred from the mapping. Runs in one process.
    """
    from otfload.checkpoint import detect_scan_layers, resolve_scan_layers

    if not Path(checkpoint_dir).is_dir():
        raise NativeCheckpointError(f"{checkpoint_dir} is not a native checkpoint directory")
    with _open(checkpoint_dir) as manager:
        step = manager.resolve_step(step)
        where = f"{manager.directory} step {step}"
        layout = manager.metadata(step)
        specs = manager.leaf_specs(step)
        stored = detect_scan_layers(specs)
        saved = None if layout is None else layout.scan_layers
        resolved = resolve_scan_layers(scan_layers, saved, source=where, default=bool(stored))
        if stored is not None and resolved != stored:
            raise ScanLayersMismatchError(
                f"scan_layers={resolved} was requested, but the parameters of {where} are "
                f"{'scanned' if stored else 'unscanned'}"
            )
        job = ExportJob.build(specs, _hf_config(layout, config, where), dtype=dtype)
        with atomic_dir(out_dir, overwrite) as tmp, write_progress(sum(s.nbytes for s in job.specs), progress) as bar:
            files = ShardFiles(tmp, job.specs, max_shard_size, bar.update)
            for leaves, keys in _groups(job):
                _write(files, job, keys, _restore(manager, step, {leaf: specs[leaf] for leaf in leaves}))
            files.finish()
            write_config(tmp, job.config)
    return Path(out_dir)


def _restore(
    manager: OrbaxCheckpointManager, step: int, specs: Mapping[str, jax.ShapeDtypeStruct]
) -> dict[str, jax.Array]:
    """The leaves ``specs`` names, restored onto the host (the first CPU device)."""
    from otfload.checkpoint.paths import flatten_tree, unflatten_tree

    cpu = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
    abstract = {
        leaf: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu)  # type: ignore[no-untyped-call]  # jax: untyped
        for leaf, s in specs.items()
    }
    return flatten_tree(manager.restore_leaves(step, unflatten_tree(abstract)))


def _write(files: ShardFiles, job: ExportJob, keys: list[str], arrays: Mapping[str, jax.Array]) -> None:
    produce = job.producer(lambda leaf, index: gather_slice(arrays[leaf], index))
    for key in keys:
        files.write(key, produce(key))
