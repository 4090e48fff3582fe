"""The public entry points: ``from_pretrained`` (a ready, sharded NNX model), ``load_params`` (a
model or parameter pytree the user brings, filled), and ``plan_model`` / ``plan_params`` (what
either would do, from the headers alone). Their docstrings are NumPy-style, each with an example
that ``tests/docs/test_docstrings.py`` runs."""

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
from otfload.place.collective_route import resolve_policy
from otfload.place.loader import ACCELERATOR_WORKERS, DEFAULT_WORKERS, REMOTE_WORKERS, execute_plan
from otfload.place.report import LoadReport
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


def default_workers(source: Source, devices: Sequence[Any] | None = None) -> int:
    """Builder threads: few for local files onto CPU devices (CPU-bound), more for remote ones
    (latency-bound) and for local files onto accelerators (one copy per byte, spread over the CPUs)."""
    if isinstance(source, CombinedSource):  # a base with adapters: the base's bytes dominate
        source = source.base
    if not isinstance(source, LocalSource):
        return REMOTE_WORKERS
    devices = jax.local_devices() if devices is None else devices
    if any(d.platform != "cpu" for d in devices):
        return max(DEFAULT_WORKERS, min(ACCELERATOR_WORKERS, (os.cpu_count() or 1) // 2))
    return DEFAULT_WORKERS


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
    """Everything ``from_pretrained`` does before reading a tensor byte: what ``otfload inspect`` prints.

    Parameters
    ----------
    source, adapter, merge_adapter, mesh, rules, scan_layers, dtype, strict, quantized, shard_cache, \
shard_cache_options, verify, **source_options
        As for ``from_pretrained``; a ``timeout`` deadline starts now.

    Returns
    -------
    tuple of (nnx.Module, LoadPlan, Source)
        The abstract model (``jax.ShapeDtypeStruct`` values, no weight allocated), the load plan
        (per leaf: HF keys, hooks, stacking, sharding, bytes per device) and the opened source.
        Close the source when done unless it is the ``Source`` you passed in
        (``with otfload.sources.owned.owned(src, source): ...`` does both).

    Raises
    ------
    SourceNotFoundError, UnsupportedModelError, CheckpointMismatchError, AdapterError
        As ``from_pretrained`` would, before reading any tensor.

    Examples
    --------
    >>> import otfload
    >>> model, plan, src = otfload.plan_model("./tiny-llama", mesh=otfload.make_mesh({"fsdp": 2, "tp": 4}))
    >>> src.close()
    >>> plan.leaves["layers.attn.q.kernel"].describe()["hooks"]
    ['Reshape(shape=(4, 16, 64))']
    >>> model.layers.attn.q.kernel.get_value()
    ShapeDtypeStruct(shape=(3, 4, 16, 64), dtype=float32)
    """
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
    """Load a Hugging Face safetensors checkpoint into a ready, sharded Flax NNX model.

    The model is built abstractly (no weight allocated), planned from the safetensors headers and
    ``config.json``, and each process reads only the bytes its devices hold, placed with each
    parameter's ``NamedSharding``.

    Parameters
    ----------
    source
        A local directory, a Hub repo id (``"org/name"``), a ``gs://``/fsspec URL, or a ``Source``.
        A local file or a path that does not exist fails at once (``SourceNotFoundError``).
    adapter
        PEFT LoRA adapter(s): a location (as ``source``, or ``"org/name@revision"``), a ``Source``,
        or a list of them, merged into the base weights in order, per device box, in float32. A
        ``source`` that holds an adapter and no model loads its ``base_model_name_or_path``.
        docs/adapters.md lists what is merged and what can be kept.
    merge_adapter
        ``False`` keeps one adapter's LoRA factors as their own parameters (``LoraWeight``: base,
        ``a`` and ``b`` sharded like the base), merged one layer at a time when the model runs, so
        ``nnx.grad`` reaches ``a``/``b``; ``otfload.load_adapter`` swaps them and
        ``otfload.export_adapter`` writes them back for PEFT.
    mesh
        The device mesh (default: every device on one ``fsdp`` axis).
    rules
        Logical axis name → mesh axes (default: ``otfload.DEFAULT_RULES``).
    scan_layers
        Stack the layers on a leading axis for ``jax.lax.scan`` (one array per layer parameter);
        ``False`` keeps one parameter per layer.
    dtype
        Parameter dtype (``"bf16"``, a numpy dtype); ``None`` keeps the storage dtype.
    strict
        Make tensors no parameter uses an error (they are always reported).
    quantized
        ``"dequantize"`` decodes quantized weights (MXFP4, compressed-tensors, FP8) on load;
        ``"keep"`` places the layers' kernels packed as ``QuantizedArray`` (codes and scales),
        dequantized one layer at a time when the model runs (docs/formats.md).
    shard_cache
        A directory shared by the processes, or a ``gs://`` prefix (``True``: a single-host local
        cache): each file is fetched once cluster-wide into it, and ranges are read from there.
    shard_cache_options
        fsspec ``storage_options`` of the ``shard_cache`` location (credentials, project).
    verify
        The shard cache's integrity check of the copies it reuses: ``"record"`` (size and the hash
        recorded when the copy was filled, re-hashed only when the file changed on disk) or
        ``"full"`` (re-hashed on every load); a copy that fails is fetched again. Not the command
        line's ``otfload load --verify``, which compares the loaded model's logits with transformers.
    workers
        Builder threads (default: 2 for local files onto CPU devices, half the CPUs up to 8 onto
        accelerators, 8 for remote sources).
    host_memory_budget
        Scratch bytes in flight (default: the largest leaf).
    progress
        A progress bar in bytes on stderr (default: when stderr is a terminal).
    reshard
        When a leaf is read in the storage's own layout (a band of rows, a distinct share per
        process) and moved to its sharding by a collective: ``"auto"`` where the time model says it
        is faster, ``"always"`` wherever it fetches fewer bytes, ``"never"``; default
        ``$OTFLOAD_RESHARD``, else ``"auto"``.
    return_report
        Also return the ``LoadReport`` (bytes read and placed, requests, seconds, peak memory).
    **source_options
        Options of the source: ``revision``, ``token``, ``endpoint``, ``cache_dir``,
        ``local_files_only`` (the Hub), ``storage_options`` (fsspec), ``retry`` (a ``RetryPolicy``),
        ``timeout`` (the load's total deadline in seconds, from opening the source to the last byte;
        default ``$OTFLOAD_TIMEOUT``, else none), ``mmap`` (local directories).

    Returns
    -------
    nnx.Module or tuple of (nnx.Module, LoadReport)
        The model with every ``nnx.Param`` loaded; with ``return_report``, the report too.

    Raises
    ------
    SourceNotFoundError
        The location, repo, revision or a listed file does not exist.
    UnsupportedModelError
        ``config.json``'s ``model_type`` is not a supported family, or a field is invalid
        (``ConfigError``).
    CheckpointMismatchError
        Tensors missing, mis-shaped (or unused, with ``strict``); every problem is listed together.
    SourceUnavailableError
        A remote source did not answer within its retry bounds (``SourceTimeoutError``: past
        ``timeout``). The first read that fails for good cancels the rest of the load.
    AdapterError
        An adapter that cannot be applied to this checkpoint.
    InvalidOptionError
        A bad ``quantized`` or ``reshard`` value.

    Examples
    --------
    >>> import otfload
    >>> mesh = otfload.make_mesh({"fsdp": 2, "tp": 4})
    >>> model, report = otfload.from_pretrained("./tiny-llama", mesh=mesh, return_report=True)
    >>> model.layers.attn.q.kernel[...].sharding.spec  # [layer, heads, head_dim, embed]
    P(None, 'tp', None, 'fsdp')
    >>> report.leaves
    12
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
    """Fill a model you bring from a checkpoint, and give it back in the kind it came.

    The same planner and builder as ``from_pretrained``: each leaf is matched to HF keys by
    ``mapping``, and each process reads only the bytes its devices hold (docs/byo_model.md).

    Parameters
    ----------
    source
        The checkpoint, as for ``from_pretrained``.
    abstract
        What to fill, with no weight allocated: an abstract ``nnx.Module`` (``nnx.eval_shape``; it
        comes back with its ``nnx.Param`` values loaded), the function building one (run under
        ``jax.set_mesh(mesh)`` by ``otfload.abstract_module``), an ``nnx.State``, or a pytree of
        ``jax.ShapeDtypeStruct`` (the same tree of ``jax.Array`` comes back). Shardings come from
        the leaves (an abstract mesh made concrete on ``mesh``) or their ``out_sharding`` /
        ``sharding_names`` metadata (logical names through ``rules``).
    mapping
        A ``MappingTable``, a list of ``Rule``, or ``{leaf template: HF key template}``: dotted leaf
        paths (``layers.{layer}.attn.q.kernel``) to HF keys and the hooks in between
        (``otfload.mappings`` ships tables).
    config
        Resolves the config field names hooks use (default: the checkpoint's ``config.json``).
    adapter, merge_adapter, mesh, rules, strict, quantized, shard_cache, shard_cache_options, verify, \
workers, host_memory_budget, progress, reshard, return_report, **source_options
        As for ``from_pretrained`` (``merge_adapter=False`` needs its bundled models). With
        ``quantized="keep"`` every quantized leaf comes back as a ``QuantizedArray``.

    Returns
    -------
    Any or tuple of (Any, LoadReport)
        ``abstract``'s kind, loaded; with ``return_report``, the report too.

    Raises
    ------
    CheckpointMismatchError
        Leaves no rule maps (``UnmappedLeafError``), tensors missing or mis-shaped: all together.
    MeshRequiredError
        A leaf with sharding names and no mesh to resolve them on.
    SourceNotFoundError, SourceUnavailableError, AdapterError, InvalidOptionError
        As for ``from_pretrained``.

    Examples
    --------
    >>> import jax, numpy as np, otfload
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = otfload.make_mesh({"fsdp": 2, "tp": 4})
    >>> abstract = {"embed": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(mesh, P("tp", "fsdp")))}
    >>> params = otfload.load_params("./tiny-llama", abstract, {"embed": "model.embed_tokens.weight"}, mesh=mesh)
    >>> params["embed"].shape, params["embed"].sharding.spec
    ((256, 64), P('tp', 'fsdp'))
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
    """What ``load_params`` would do, from the headers and ``config.json`` alone.

    Parameters
    ----------
    source, abstract, mapping, config, mesh, rules, strict, **source_options
        As for ``load_params``.

    Returns
    -------
    LoadPlan
        Per leaf: the HF keys, hooks, stacking and sharding; no tensor byte is read.

    Raises
    ------
    CheckpointMismatchError, MeshRequiredError, SourceNotFoundError
        As ``load_params`` would.

    Examples
    --------
    >>> import jax, numpy as np, otfload
    >>> sharded = jax.sharding.NamedSharding(otfload.make_mesh({"fsdp": 8}), jax.sharding.PartitionSpec(None, "fsdp"))
    >>> head = jax.ShapeDtypeStruct((64, 256), np.float32, sharding=sharded)  # [embed, vocab]
    >>> table = [otfload.Rule("head", "lm_head.weight", (otfload.Transpose(),))]  # HF stores [vocab, embed]
    >>> plan = otfload.plan_params("./tiny-llama", {"head": head}, table)
    >>> plan.leaves["head"].describe()["hooks"]
    ['Transpose(perm=None)']
    """
    with owned_source(source, **source_options) as src:
        index = open_index(src, require_config=False)
        return plan_target(index, abstract, mapping, index.config if config is None else config, mesh, rules,
                           strict)[1]
