"""``export_hf``: write a loaded model (or params pytree) back as a Hugging Face checkpoint."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from otfload.errors import MappingError
from otfload.export.gather import gather_slice, leaf_arrays
from otfload.export.inverse import ExportPlan, plan_export
from otfload.export.writer import TensorSpec, atomic_dir, natural_key, write_config, write_shards
from otfload.families.registry import Family, family_for
from otfload.index.checkpoint import CONFIG_FILE, open_index, read_json
from otfload.index.dtypes import safetensors_name, to_numpy_dtype
from otfload.plan.mapping import MappingTable, Rule, as_table
from otfload.sources import Source, open_source

# config.json field naming the weights' dtype (transformers 5; older versions write torch_dtype).
_DTYPE_FIELDS = ("dtype", "torch_dtype")
_DTYPE_NAMES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "F64": "float64"}


def _reference(reference: str | os.PathLike | Source | None) -> tuple[dict | None, dict | None]:
    """``(config.json, {key: shape})`` of the reference checkpoint, read from headers only."""
    if reference is None:
        return None, None
    index = open_index(open_source(reference), require_config=False)
    return index.config or None, {k: info.shape for k, info in index.tensors.items()}


def _load_config(config: Mapping | str | os.PathLike) -> dict:
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    src = open_source(path if path.is_dir() else path.parent)
    return dict(read_json(src, CONFIG_FILE if path.is_dir() else path.name))


def _table(
    hf_config: dict, family: str | Family | None, mapping: MappingTable | Sequence[Rule] | Mapping[str, str] | None
) -> tuple[MappingTable, dict]:
    """The mapping table and the config its hooks are resolved against."""
    if mapping is not None:
        return as_table(mapping), hf_config
    if isinstance(family, str):
        family = family_for({"model_type": family})
    family = family or family_for(hf_config)
    cfg = family.parse_config(hf_config)
    return family.mapping(cfg), cfg.to_dict()


def _out_dtypes(plan: ExportPlan, arrays: Mapping[str, Any], dtype: Any) -> dict[str, np.dtype]:
    if dtype is not None:
        target = to_numpy_dtype(dtype)
        safetensors_name(target)  # a dtype safetensors cannot store fails before anything is written
        return dict.fromkeys(plan.tensors, target)
    return {k: np.dtype(arrays[t.parts[0].leaf].dtype) for k, t in plan.tensors.items()}


def export_hf(
    model_or_params: Any,
    out_dir: str | os.PathLike,
    *,
    config: Mapping | str | os.PathLike | None = None,
    reference: str | os.PathLike | Source | None = None,
    family: str | Family | None = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str] | None = None,
) -> Path:
    """Write ``model_or_params`` to ``out_dir`` as an HF safetensors checkpoint; returns the path.

    ``model_or_params`` is an NNX model (its ``nnx.Param`` s) or a pytree of arrays, scanned or
    not, sharded or not. ``config`` is the HF ``config.json`` (a dict, or a path to the file or
    its directory); ``reference`` — the checkpoint the model was loaded from, anything
    ``from_pretrained`` accepts — supplies it by default and gives the exact HF tensor shapes
    (otherwise inferred from the mapping). The family's table (from ``config["model_type"]``, or
    ``family=``) or ``mapping=`` is inverted. ``dtype`` ``None`` keeps each leaf's dtype; ``"bf16"``,
    ``"f32"`` or a numpy dtype casts. Shards hold at most ``max_shard_size`` (``"5GB"``, ``"500MiB"``,
    bytes). The write is atomic; an existing ``out_dir`` is replaced only with ``overwrite=True``.
    """
    ref_config, hf_shapes = _reference(reference)
    if config is None and ref_config is None:
        raise MappingError("export_hf needs the HF config: pass config= (dict or config.json path) or reference=")
    hf_config = _load_config(config) if config is not None else ref_config
    table, hook_config = _table(hf_config, family, mapping)
    arrays = leaf_arrays(model_or_params)
    leaf_shapes = {path: tuple(a.shape) for path, a in arrays.items()}
    plan = plan_export(leaf_shapes, table, hook_config, hf_shapes, tied=bool(hf_config.get("tie_word_embeddings")))
    dtypes = _out_dtypes(plan, arrays, dtype)
    specs = [TensorSpec(k, plan.tensors[k].shape, dtypes[k]) for k in sorted(plan.tensors, key=natural_key)]

    def produce(key: str) -> np.ndarray:
        x = plan.tensors[key].materialize(lambda leaf, index: gather_slice(arrays[leaf], index))
        return x.astype(dtypes[key], copy=False)

    if dtype is not None:
        name = _DTYPE_NAMES.get(safetensors_name(to_numpy_dtype(dtype)))
        hf_config = {**hf_config, **{f: name for f in _DTYPE_FIELDS if f in hf_config or f == "dtype"}}
    with atomic_dir(out_dir, overwrite) as tmp:
        write_shards(tmp, specs, produce, max_shard_size)
        write_config(tmp, hf_config)
    return Path(out_dir)


def export_checkpoint(
    source: str | os.PathLike | Source,
    out_dir: str | os.PathLike,
    *,
    scan_layers: bool = True,
    mesh: Any = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    **source_options,
) -> Path:
    """What ``otfload export SRC OUT`` runs: load the HF checkpoint ``source`` with
    :func:`otfload.from_pretrained` (sharded on ``mesh``) and write it back with :func:`export_hf`,
    using ``source`` as the reference (config and shapes)."""
    from otfload.api import from_pretrained

    src = open_source(source, **source_options)
    model = from_pretrained(src, mesh=mesh, scan_layers=scan_layers)
    return export_hf(model, out_dir, reference=src, dtype=dtype, max_shard_size=max_shard_size, overwrite=overwrite)
