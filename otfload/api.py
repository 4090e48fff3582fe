"""The public entry points: :func:`from_pretrained` (a ready, sharded NNX model) and
:func:`load_params` (a parameter pytree for a model the user brings)."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from otfload.build.loader import DEFAULT_WORKERS, REMOTE_WORKERS, execute_plan
from otfload.build.report import LoadReport
from otfload.cache import wrap_with_cache
from otfload.families.registry import family_for
from otfload.index.checkpoint import CheckpointIndex, open_index
from otfload.index.dtypes import to_numpy_dtype
from otfload.index.quant import QuantizedTensor
from otfload.plan.abstract import abstract_from_nnx, abstract_from_pytree, dotted
from otfload.plan.mapping import MappingTable, Rule, as_table
from otfload.plan.planner import LoadPlan, build_plan
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, make_mesh
from otfload.sources import LocalSource, Source, open_source

ShardCacheSpec = str | os.PathLike | bool | None


def open_cached(
    source: str | os.PathLike | Source, shard_cache: ShardCacheSpec, shard_cache_options: dict | None, **options
) -> Source:
    """Open ``source`` and, when asked, put the distributed shard cache in front of it."""
    return wrap_with_cache(open_source(source, **options), shard_cache, storage_options=shard_cache_options)


def default_workers(source: Source) -> int:
    """Builder threads: few for local files (CPU-bound), more for remote ones (latency-bound)."""
    return DEFAULT_WORKERS if isinstance(source, LocalSource) else REMOTE_WORKERS


def run_plan(
    plan: LoadPlan, src: Source, owned: bool, workers: int | None, host_memory_budget: int | None,
    progress: bool | None,
) -> tuple[dict[str, jax.Array], LoadReport]:
    """Execute ``plan``; a source this call opened itself (``owned``) is closed afterwards."""
    try:
        return execute_plan(
            plan, src, workers=workers or default_workers(src), host_memory_budget=host_memory_budget,
            progress=progress,
        )
    finally:
        if owned:
            src.close()


def storage_dtype(index: CheckpointIndex) -> np.dtype:
    """The dtype holding most of the checkpoint's floating-point bytes; quantized weights count as
    bf16, the dtype they were trained in."""
    weights = Counter()
    for info in index.tensors.values():
        if isinstance(info, QuantizedTensor):
            weights[np.dtype(ml_dtypes.bfloat16)] += 2 * math.prod(info.shape)
        elif np.issubdtype(info.dtype, np.floating) or info.dtype.kind == "V":
            weights[info.dtype] += info.nbytes
    if not weights:
        return np.dtype(np.float32)
    dtype = weights.most_common(1)[0][0]
    return dtype


def plan_model(
    source: str | os.PathLike | Source,
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    scan_layers: bool = True,
    dtype: Any = None,
    strict: bool = False,
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict | None = None,
    **source_options,
) -> tuple[nnx.Module, LoadPlan, Source]:
    """Everything :func:`from_pretrained` does before reading a tensor byte: the abstract model
    (no weights allocated), the load plan and the opened source (close it when done, unless you
    passed it in). ``otfload inspect`` prints this plan."""
    src = open_cached(source, shard_cache, shard_cache_options, **source_options)
    try:
        index = open_index(src)
        family = family_for(index.config)
        cfg = family.parse_config(index.config)
        dtype = storage_dtype(index) if dtype is None else to_numpy_dtype(dtype)
        mesh = make_mesh() if mesh is None else mesh
        model = nnx.eval_shape(lambda: family.build(cfg, scan_layers=scan_layers, dtype=dtype, rngs=nnx.Rngs(0)))
        leaves = abstract_from_nnx(model, mesh, DEFAULT_RULES if rules is None else rules)
        plan = build_plan(index, leaves, family.mapping(cfg), cfg.to_dict(), strict=strict)
    except BaseException:
        if not isinstance(source, Source):
            src.close()
        raise
    return model, plan, src


def from_pretrained(
    source: str | os.PathLike | Source,
    *,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    scan_layers: bool = True,
    dtype: Any = None,
    strict: bool = False,
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict | None = None,
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    return_report: bool = False,
    **source_options,
) -> nnx.Module | tuple[nnx.Module, LoadReport]:
    """Load an HF safetensors checkpoint into a ready, sharded Flax NNX model.

    ``source`` is a local directory, a Hub repo id (``revision=``, ``token=``, ``endpoint=``,
    ``cache_dir=``, ``local_files_only=`` go to the source) or a ``gs://``/fsspec URL. ``mesh``
    defaults to every device on one ``fsdp`` axis; ``rules`` map logical axes to mesh axes;
    ``dtype=None`` keeps the storage dtype. With ``strict=True`` tensors no leaf uses are an
    error. ``shard_cache`` (a shared directory or ``gs://`` prefix; ``True`` for a single-host local
    cache) fetches each file once across all processes before reading ranges from the cache.
    ``host_memory_budget`` caps scratch bytes in flight (default: the largest leaf); ``workers``
    builder threads run at once (default 2 locally, 8 remote). ``return_report=True`` returns
    ``(model, LoadReport)``.
    """
    model, plan, src = plan_model(
        source, mesh=mesh, rules=rules, scan_layers=scan_layers, dtype=dtype, strict=strict,
        shard_cache=shard_cache, shard_cache_options=shard_cache_options, **source_options,
    )
    arrays, report = run_plan(plan, src, not isinstance(source, Source), workers, host_memory_budget, progress)
    state = nnx.state(model, nnx.Param)
    loaded = [(path, var.replace(arrays[dotted(path)])) for path, var in nnx.to_flat_state(state)]
    nnx.update(model, nnx.from_flat_state(loaded))
    return (model, report) if return_report else model


def load_params(
    source: str | os.PathLike | Source,
    abstract: Any,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str],
    *,
    config: Mapping | None = None,
    mesh: Mesh | None = None,
    strict: bool = False,
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict | None = None,
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    return_report: bool = False,
    **source_options,
) -> Any:
    """Fill a pytree of ``jax.ShapeDtypeStruct`` (with ``.sharding``) from a checkpoint.

    ``mapping`` matches dotted leaf paths (``params.layers.attn.q.kernel``) to HF key templates;
    ``config`` (default: the checkpoint's ``config.json``) resolves config names in hooks. Returns
    the same tree structure with ``jax.Array`` leaves (and the report if asked). Other options are
    those of :func:`from_pretrained`.
    """
    src = open_cached(source, shard_cache, shard_cache_options, **source_options)
    try:
        index = open_index(src, require_config=False)
        leaves, treedef = abstract_from_pytree(abstract, mesh)
        plan = build_plan(index, leaves, as_table(mapping), index.config if config is None else config, strict=strict)
    except BaseException:
        if not isinstance(source, Source):
            src.close()
        raise
    arrays, report = run_plan(plan, src, not isinstance(source, Source), workers, host_memory_budget, progress)
    tree = jax.tree_util.tree_unflatten(treedef, [arrays[path] for path in leaves])
    return (tree, report) if return_report else tree
