"""The public entry points: :func:`from_pretrained` (a ready, sharded NNX model) and
:func:`load_params` (a parameter pytree for a model the user brings)."""

from __future__ import annotations

import math
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from typing import Any, Literal, overload

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from otfload.adapters import AdaptedTensor, CombinedSource, check_adapted_are_mapped, open_adapted
from otfload.adapters.kept import prepare_kept, require_merged
from otfload.adapters.load import AdapterSpec
from otfload.cache import wrap_with_cache
from otfload.errors import CheckpointMismatchError, mismatch_error
from otfload.families.registry import family_for
from otfload.index.checkpoint import CheckpointIndex, open_index, read_values
from otfload.index.derived import is_derived
from otfload.index.dtypes import to_numpy_dtype
from otfload.models.origin import remember_origin
from otfload.place.loader import DEFAULT_WORKERS, REMOTE_WORKERS, execute_plan
from otfload.place.report import LoadReport
from otfload.place.reshard import resolve_policy
from otfload.place.warmup import start_first_transfers
from otfload.plan.abstract import Target, abstract_from_nnx, abstract_target, dotted, unmapped_problems
from otfload.plan.eval_shape import abstract_module
from otfload.plan.keep import LAYER_LEAF, assemble_kept, check_quantized_mode, keep_plan
from otfload.plan.mapping import MappingTable, Rule, as_table
from otfload.plan.planner import LoadPlan, build_plan
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, make_mesh
from otfload.sources import LocalSource, Source, open_source
from otfload.sources.owned import is_owned, owned, owned_source

ShardCacheSpec = str | os.PathLike[str] | bool | None


def open_cached(
    source: str | os.PathLike[str] | Source,
    shard_cache: ShardCacheSpec,
    shard_cache_options: dict[str, Any] | None,
    verify: str = "record",
    **options: Any,
) -> Source:
    """Open ``source`` and, when asked, put the distributed shard cache in front of it. The cache
    owns the source only if it was opened here; that one is closed again if the cache fails."""
    with ExitStack() as on_error:
        src = on_error.enter_context(owned(open_source(source, **options), source))
        cached = wrap_with_cache(src, shard_cache, storage_options=shard_cache_options, verify=verify,
                                 owns_source=is_owned(src, source))
        on_error.pop_all()  # success: the caller owns ``cached``
    return cached


def default_workers(source: Source) -> int:
    """Builder threads: few for local files (CPU-bound), more for remote ones (latency-bound)."""
    if isinstance(source, CombinedSource):  # a base with adapters: the base's bytes dominate
        source = source.base
    return DEFAULT_WORKERS if isinstance(source, LocalSource) else REMOTE_WORKERS


def run_plan(
    plan: LoadPlan, src: Source, given: object, workers: int | None, host_memory_budget: int | None,
    progress: bool | None, reshard: str | None = None,
) -> tuple[dict[str, jax.Array], LoadReport]:
    """Execute ``plan``; ``src`` is closed afterwards unless it is ``given``, the caller's own source."""
    with owned(src, given):
        arrays, report = execute_plan(
            plan, src, workers=workers or default_workers(src), host_memory_budget=host_memory_budget,
            progress=progress, reshard=reshard,
        )
        infos = list(plan.activation.values())
        report.activation_scales = dict(zip(plan.activation, read_values(src, infos), strict=True))
        return arrays, report


def storage_dtype(index: CheckpointIndex) -> np.dtype[Any]:
    """The dtype holding most of the checkpoint's floating-point bytes; quantized weights count as
    bf16, the dtype they were trained in, and a weight with adapters merged in as its base."""
    weights: Counter[np.dtype[Any]] = Counter()
    for info in index.tensors.values():
        if isinstance(info, AdaptedTensor):
            info = info.base
        if is_derived(info):
            weights[np.dtype(ml_dtypes.bfloat16)] += 2 * math.prod(info.shape)
        elif np.issubdtype(info.dtype, np.floating) or info.dtype.kind == "V":
            weights[info.dtype] += info.nbytes
    if not weights:
        return np.dtype(np.float32)
    dtype: np.dtype[Any] = weights.most_common(1)[0][0]
    return dtype


def plan_model(
    source: str | os.PathLike[str] | Source,
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    scan_layers: bool = True,
    dtype: Any = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    **source_options: Any,
) -> tuple[nnx.Module, LoadPlan, Source]:
    """Everything :func:`from_pretrained` does before reading a tensor byte: the abstract model
    (no weights allocated), the load plan and the opened source (close it when done, unless it is
    the :class:`Source` you passed in: ``with otfload.sources.owned.owned(src, source)``).
    ``otfload inspect`` prints this plan. ``source_options`` (``timeout=``, ``retry=``, ...) go to
    :func:`~otfload.sources.open_source`; the ``timeout`` deadline starts now.
    ``adapter`` (PEFT LoRA adapters, merged in order) is described in :func:`from_pretrained`."""
    src, index, _ = open_adapted(
        source, adapter, lambda location, **options: open_cached(
            location, shard_cache, shard_cache_options, verify, **options),
        merge_adapter=merge_adapter, check_config=family_for, **source_options,
    )
    with ExitStack() as on_error:  # planning fails: close what this call opened
        on_error.enter_context(owned(src, source))
        family = family_for(index.config)
        cfg = family.config_for(index.config, index.tensors)  # typed, bounded, matched to the tensors
        dtype = storage_dtype(index) if dtype is None else to_numpy_dtype(dtype)
        mesh = make_mesh() if mesh is None else mesh
        model = abstract_module(lambda: family.build(cfg, scan_layers=scan_layers, dtype=dtype, rngs=None))
        remember_origin(model, index.config, family.name)
        leaves = abstract_from_nnx(model, mesh, DEFAULT_RULES if rules is None else rules)
        plan = build_plan(index, leaves, family.mapping(cfg), cfg.to_dict(), strict=strict)
        check_adapted_are_mapped(plan, index)
        plan = keep_plan(plan, quantized, lambda path: LAYER_LEAF.match(path) is not None)
        plan.family, plan.config = family.name, index.config
        on_error.pop_all()  # planned: the caller closes ``src`` unless it passed it in
    return model, plan, src


@overload
def from_pretrained(
    source: str | os.PathLike[str] | Source,
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    scan_layers: bool = True,
    dtype: Any = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    return_report: Literal[False] = False,
    **source_options: Any,
) -> nnx.Module: ...


@overload
def from_pretrained(
    source: str | os.PathLike[str] | Source,
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    scan_layers: bool = True,
    dtype: Any = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    return_report: Literal[True],
    **source_options: Any,
) -> tuple[nnx.Module, LoadReport]: ...


def from_pretrained(
    source: str | os.PathLike[str] | Source,
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    scan_layers: bool = True,
    dtype: Any = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    return_report: bool = False,
    **source_options: Any,
) -> nnx.Module | tuple[nnx.Module, LoadReport]:
    """Load an HF safetensors checkpoint into a ready, sharded Flax NNX model.

    ``source`` is a local directory, a Hub repo id (``revision=``, ``token=``, ``endpoint=``,
    ``cache_dir=``, ``local_files_only=`` go to the source) or a ``gs://``/fsspec URL
    (``storage_options=``). Remote sources take ``retry=`` (a ``RetryPolicy``: attempts, backoff, the
    idle and per-attempt time bounds) and ``timeout=``: the total deadline of the load in seconds,
    from opening the source to the last byte (default: the ``OTFLOAD_TIMEOUT`` environment variable,
    else no limit); past it the load fails with ``SourceTimeoutError`` naming the URL and the bytes
    received. The first read that fails for good cancels the rest of the load. ``mesh``
    defaults to every device on one ``fsdp`` axis; ``rules`` map logical axes to mesh axes;
    ``dtype=None`` keeps the storage dtype. With ``strict=True`` tensors no leaf uses are an
    error. ``shard_cache`` (a shared directory or ``gs://`` prefix; ``True`` for a single-host local
    cache) fetches each file once across all processes before reading ranges from the cache;
    ``verify`` is how it checks the copies it reuses: ``"record"`` (size and the hash record made
    when the copy was filled; re-hashed only when the file changed on disk) or ``"full"``
    (re-hashed on every load). A copy that fails is fetched again (``CacheIntegrityError`` if the
    source cannot be reached).
    ``host_memory_budget`` caps scratch bytes in flight (default: the largest leaf); ``workers``
    builder threads run at once (default 2 locally, 8 remote). ``reshard`` says when a leaf is read
    in the storage's own layout (a band: contiguous rows, a distinct share per process) and moved to
    its sharding by a collective over the devices: ``"auto"`` where the cost model of
    :mod:`otfload.place.reshard` says it is faster, ``"always"`` wherever that fetches fewer bytes
    (column-split leaves; leaves several processes hold, so each byte is read once cluster-wide),
    ``"never"``; default: ``$OTFLOAD_RESHARD``, else ``"auto"``. ``return_report=True`` returns
    ``(model, LoadReport)``.

    ``adapter`` is a PEFT LoRA adapter (any location a checkpoint can be, ``"org/name@revision"``, or
    a ``Source``) or a list of them, merged into the base weights in order, per device box, in
    float32; its bytes count in the report. A ``source`` that holds an adapter and no model loads
    its ``base_model_name_or_path``. ``merge_adapter=False`` keeps one adapter's LoRA factors as
    their own parameters: each adapted layer kernel becomes a
    :class:`~otfload.adapters.weight.LoraWeight` (base, ``a``, ``b`` sharded like the base, rank
    replicated) that the model merges one layer at a time when it runs, so ``nnx.grad`` reaches
    ``a``/``b``; :func:`otfload.load_adapter` swaps the adapter on the loaded base and
    :func:`otfload.export_adapter` writes it back for PEFT. docs/adapters.md lists what is merged
    and what can be kept.

    ``quantized`` says what becomes of quantized weights (MXFP4, compressed-tensors, FP8):
    ``"dequantize"`` (default) decodes them on load into the leaf dtype; ``"keep"`` places the
    layers' quantized kernels packed, as :class:`~otfload.quantized.QuantizedArray` (stored codes and
    scales, sharded together; ``otfload.dequantize`` decodes one), which the model dequantizes one
    layer at a time when it runs (docs/formats.md, "Keep it quantized").
    """
    resolve_policy(reshard)  # a bad value fails before anything is opened
    check_quantized_mode(quantized)
    start_first_transfers(jax.local_devices())  # an accelerator's one-time set-up, meanwhile
    model, plan, src = plan_model(
        source, adapter=adapter, merge_adapter=merge_adapter, mesh=mesh, rules=rules, scan_layers=scan_layers,
        dtype=dtype, strict=strict, shard_cache=shard_cache, shard_cache_options=shard_cache_options,
        verify=verify, quantized=quantized, **source_options,
    )
    lora = None if merge_adapter else prepare_kept(plan, src, source)  # LoRA kept: the plan reads the bases
    arrays, report = run_plan(plan if lora is None else lora.plan, src, source, workers, host_memory_budget,
                              progress, reshard)
    arrays = assemble_kept(plan, arrays)
    arrays = arrays if lora is None else lora.finish(model, arrays, report)
    state = nnx.state(model, nnx.Param)
    loaded = [(path, var.replace(arrays[dotted(path)])) for path, var in nnx.to_flat_state(state)]
    nnx.update(model, nnx.from_flat_state(loaded))
    return (model, report) if return_report else model


@overload
def load_params(
    source: str | os.PathLike[str] | Source,
    abstract: Any,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str],
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    config: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    return_report: Literal[False] = False,
    **source_options: Any,
) -> Any: ...


@overload
def load_params(
    source: str | os.PathLike[str] | Source,
    abstract: Any,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str],
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    config: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    return_report: Literal[True],
    **source_options: Any,
) -> tuple[Any, LoadReport]: ...


def load_params(
    source: str | os.PathLike[str] | Source,
    abstract: Any,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str],
    *,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None,
    merge_adapter: bool = True,
    config: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    strict: bool = False,
    quantized: str = "dequantize",
    shard_cache: ShardCacheSpec = None,
    shard_cache_options: dict[str, Any] | None = None,
    verify: str = "record",
    workers: int | None = None,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    return_report: bool = False,
    **source_options: Any,
) -> Any:
    """Fill a model the user brings from a checkpoint, and give it back in the kind it came.

    ``abstract`` is an abstract ``nnx.Module`` (``nnx.eval_shape``; the module comes back with its
    ``nnx.Param`` s loaded) or the function building it (``lambda: Model(config, rngs=nnx.Rngs(0))``,
    run under ``jax.set_mesh(mesh)`` by :func:`~otfload.plan.eval_shape.abstract_module`, several
    times faster than ``nnx.eval_shape`` on JAX ≤ 0.10), an ``nnx.State`` (a loaded ``nnx.State``
    comes back) or a pytree of
    ``jax.ShapeDtypeStruct`` (the same tree of ``jax.Array`` s). Shardings come from the leaves
    (an abstract mesh made concrete on ``mesh``) or their ``out_sharding``/``sharding_names``
    metadata (logical names through ``rules``); see :mod:`otfload.plan.abstract`. ``mapping``
    matches dotted leaf paths (``layers.attn.q.kernel``) to HF key templates (``otfload.mappings``
    ships tables); ``config`` (default: the checkpoint's ``config.json``) resolves config names in
    hooks. Other options are those of :func:`from_pretrained`; the report comes too if asked. With
    ``quantized="keep"`` every quantized leaf comes back as a :class:`~otfload.quantized.QuantizedArray`.
    """
    resolve_policy(reshard)  # a bad value fails before anything is opened
    require_merged(merge_adapter)  # kept LoRA factors need the bundled models (from_pretrained)
    check_quantized_mode(quantized)
    start_first_transfers(jax.local_devices())  # an accelerator's one-time set-up, meanwhile
    src, index, _ = open_adapted(
        source, adapter, lambda location, **options: open_cached(
            location, shard_cache, shard_cache_options, verify, **options),
        merge_adapter=merge_adapter, require_config=False, **source_options,
    )
    with ExitStack() as on_error:  # planning fails: close what this call opened
        on_error.enter_context(owned(src, source))
        target, plan = plan_target(index, abstract, mapping, index.config if config is None else config, mesh, rules,
                                   strict)
        plan = keep_plan(plan, quantized)
        plan.config = index.config
        on_error.pop_all()  # run_plan closes it
    arrays, report = run_plan(plan, src, source, workers, host_memory_budget, progress, reshard)
    tree = target.rebuild(assemble_kept(plan, arrays))
    return (tree, report) if return_report else tree


def plan_target(
    index: CheckpointIndex, abstract: Any, mapping: MappingTable | Sequence[Rule] | Mapping[str, str],
    config: Mapping[str, Any], mesh: Mesh | None, rules: LogicalRules | None, strict: bool,
) -> tuple[Target, LoadPlan]:
    """The target's leaves and their plan; unmapped leaves and checkpoint problems raise together."""
    table = as_table(mapping)
    target = abstract_target(abstract, mesh, rules)
    unmapped = unmapped_problems(target.leaves, table)
    names = {p.leaf for p in unmapped}
    try:
        plan = build_plan(index, {k: v for k, v in target.leaves.items() if k not in names}, table, config,
                          strict=strict)
    except CheckpointMismatchError as e:
        raise mismatch_error([*unmapped, *e.problems]) from None
    if unmapped:
        raise mismatch_error(unmapped)
    return target, plan


def plan_params(
    source: str | os.PathLike[str] | Source,
    abstract: Any,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str],
    *,
    config: Mapping[str, Any] | None = None,
    mesh: Mesh | None = None,
    rules: LogicalRules | None = None,
    strict: bool = False,
    **source_options: Any,
) -> LoadPlan:
    """What :func:`load_params` would do, from headers and ``config.json`` alone: the plan of every
    leaf (HF keys, hooks, shardings), no tensor byte read. Raises the errors the load would."""
    with owned_source(source, **source_options) as src:
        index = open_index(src, require_config=False)
        return plan_target(index, abstract, mapping, index.config if config is None else config, mesh, rules,
                           strict)[1]
