"""The public entry points: ``from_pretrained`` (a ready, sharded NNX model), ``load_params`` (a
model or parameter pytree the user brings, filled), and ``plan_model`` / ``plan_params`` (what
either would do, from the headers alone). Each takes the load's options as one
:class:`~otfload.options.LoadOptions` (``options=``) and as keyword arguments, merged by
:func:`~otfload.options.resolve_options`; each opens its checkpoint through the one front door,
:func:`~otfload.opening.open_checkpoint`. Their docstrings are NumPy-style, each with an example
that ``tests/docs/test_docstrings.py`` runs.

Optional features (adapters, ``quantized="keep"``, kept LoRA factors, activation scales) are
:mod:`otfload.stages`: the entry points choose them from the options and run them in order; a
plain load runs none."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Literal, Unpack, overload

import jax
from flax import nnx
from jax.sharding import Mesh

from otfload.coordination.agreement import DEFAULT_TIMEOUT_S
from otfload.errors import CheckpointMismatchError, mismatch_error
from otfload.families.registry import family_for
from otfload.index.checkpoint import CheckpointIndex
from otfload.index.dtypes import to_numpy_dtype
from otfload.models.origin import remember_origin
from otfload.opening import Opened, default_workers, open_checkpoint, storage_dtype
from otfload.options import MODEL_FIELDS, LoadKeywords, LoadOptions, ParamsKeywords, resolve_options
from otfload.place.collective_route import resolve_policy
from otfload.place.loader import execute_plan
from otfload.place.report import LoadReport
from otfload.place.warmup import start_first_transfers
from otfload.plan.abstract import Target, abstract_from_nnx, abstract_target, dotted, unmapped_problems
from otfload.plan.eval_shape import abstract_module
from otfload.plan.mapping import MappingTable, Rule, as_table
from otfload.plan.planner import LoadPlan, build_plan
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, make_mesh
from otfload.replicated import warn_replicated
from otfload.sources import Source
from otfload.sources.owned import owned
from otfload.stages import Loaded, Stage, option_stages, plan_finishers, plan_stages

Location = str | os.PathLike[str] | Source
TableSpec = MappingTable | Sequence[Rule] | Mapping[str, str]


def plan_model(
    source: Location, *, options: LoadOptions | None = None, **keywords: Unpack[LoadKeywords]
) -> tuple[nnx.Module, LoadPlan, Source]:
    """Everything ``from_pretrained`` does before reading a tensor byte: what ``otfload inspect`` prints.

    Parameters
    ----------
    source, options, **keywords
        As for ``from_pretrained`` (the options of the reads, ``workers``, ``host_memory_budget``,
        ``progress`` and ``reshard``, are not used); a ``timeout`` deadline starts now.

    Returns
    -------
    tuple of (nnx.Module, LoadPlan, Source)
        The abstract model (``jax.ShapeDtypeStruct`` values, no weight allocated), the load plan
        (per leaf: HF keys, hooks, stacking, sharding, bytes per device) and the opened source.
        Close the source when done unless it is the ``Source`` you passed in
        (``with otfload.sources.owned.owned(src, source): ...`` does both).

    Raises
    ------
    SourceNotFoundError, UnsupportedModelError, CheckpointMismatchError, AdapterError, InvalidOptionError
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
    model, plan, opened, _ = _plan_model(source, resolve_options(options, keywords))
    return model, plan, opened.source


def _plan_model(source: Location, options: LoadOptions) -> tuple[nnx.Module, LoadPlan, Opened, tuple[Stage, ...]]:
    """``plan_model``, with the opened checkpoint (its base too) in place of its source, and the
    load's stages (the front door's overlay, then the options')."""
    asked = option_stages(options, bundled=True)
    opened = open_checkpoint(source, options, check_config=family_for)
    with ExitStack() as on_error:  # planning fails: close what this call opened
        on_error.enter_context(owned(opened.source, source))
        index = opened.index
        family = family_for(index.config)
        cfg = family.config_for(index.config, index.tensors)  # typed, bounded, matched to the tensors
        dtype = storage_dtype(opened.base_index) if options.dtype is None else to_numpy_dtype(options.dtype)
        mesh = make_mesh() if options.mesh is None else options.mesh
        model = abstract_module(lambda: family.build(cfg, scan_layers=options.scan_layers, dtype=dtype, rngs=None))
        remember_origin(model, index.config, family.name)
        leaves = abstract_from_nnx(model, mesh, DEFAULT_RULES if options.rules is None else options.rules)
        plan = build_plan(index, leaves, family.mapping(cfg), cfg.to_dict(), strict=options.strict)
        stages = (*opened.stages, *asked)
        plan = plan_stages(stages, dataclasses.replace(plan, family=family.name, config=index.config))
        on_error.pop_all()  # planned: the caller closes the source unless it passed it in
    return model, plan, opened, stages


@overload
def from_pretrained(
    source: Location, *, options: LoadOptions | None = None, return_report: Literal[False] = False,
    **keywords: Unpack[LoadKeywords],
) -> nnx.Module: ...


@overload
def from_pretrained(
    source: Location, *, options: LoadOptions | None = None, return_report: Literal[True],
    **keywords: Unpack[LoadKeywords],
) -> tuple[nnx.Module, LoadReport]: ...


def from_pretrained(
    source: Location, *, options: LoadOptions | None = None, return_report: bool = False,
    **keywords: Unpack[LoadKeywords],
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
    options
        The load's options in one ``otfload.LoadOptions`` (each field is described there).
    return_report
        Also return the ``LoadReport`` (bytes read and placed, requests, seconds, peak memory).
    **keywords
        ``LoadOptions`` fields by name, merged into ``options``: ``mesh``, ``rules``,
        ``scan_layers``, ``dtype``, ``strict``, ``quantized``, ``adapter``, ``merge_adapter``,
        ``shard_cache``, ``shard_cache_options``, ``verify``, ``workers``, ``host_memory_budget``,
        ``progress``, ``reshard``, and the source's ``revision``, ``token``, ``endpoint``,
        ``cache_dir``, ``local_files_only``, ``storage_options``, ``retry``, ``timeout``, ``mmap``.
        A keyword that repeats a field ``options`` sets to another value is an ``InvalidOptionError``.

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
        A bad ``quantized``, ``reshard`` or ``verify`` value, or an option given twice.

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
    model, report = plan_load(source, resolve_options(options, keywords)).load()
    return (model, report) if return_report else model


@dataclass(frozen=True)
class PlannedLoad:
    """``from_pretrained`` cut in two: :func:`plan_load` has planned ``source`` (``model`` is the
    abstract model, ``plan`` its load plan, the checkpoint is open), :meth:`load` reads and places.
    What happens in between (``otfload.training`` compiles a step against the plan) plans nothing
    again."""

    model: nnx.Module
    plan: LoadPlan
    opened: Opened
    given: Location
    options: LoadOptions
    policy: str
    stages: tuple[Stage, ...] = ()

    def load(self) -> tuple[nnx.Module, LoadReport]:
        """Read and place every leaf into :attr:`model` (now loaded, and returned) with the report;
        the checkpoint is closed afterwards unless it is the ``Source`` the caller passed in."""
        model, plan, opened, given = self.model, self.plan, self.opened, self.given
        for stage in self.stages:  # what a stage reads before the leaves (kept LoRA factors)
            plan = stage.read(plan, opened.source, given)
        arrays, report = run_plan(plan, opened, given, self.options, self.policy, self.stages, model)
        state = nnx.state(model, nnx.Param)
        loaded = [(path, var.replace(arrays[dotted(path)])) for path, var in nnx.to_flat_state(state)]
        nnx.update(model, nnx.from_flat_state(loaded))
        return model, report


def plan_load(source: Location, options: LoadOptions) -> PlannedLoad:
    """What ``from_pretrained(source, options=options)`` does before reading a tensor byte (the
    checkpoint stays open for :meth:`PlannedLoad.load`)."""
    policy = resolve_policy(options.reshard)  # resolve_options took $OTFLOAD_RESHARD, checked
    start_first_transfers(jax.local_devices())  # an accelerator's one-time set-up, meanwhile
    model, plan, opened, stages = _plan_model(source, options)
    warn_replicated({path: p.leaf for path, p in plan.leaves.items()}, options.rules)  # once per load
    return PlannedLoad(model, plan, opened, source, options, policy, stages)


def run_plan(
    plan: LoadPlan, opened: Opened, given: object, options: LoadOptions, policy: str,
    stages: tuple[Stage, ...] = (), model: Any = None,
) -> tuple[dict[str, Any], LoadReport]:
    """Execute ``plan`` with the reshard ``policy``, then the finishers of ``stages`` and of the plan
    (into ``model``'s leaf values: ``model`` is the bundled model, None for a tree the caller brings);
    the opened source is closed afterwards unless it is ``given``, the caller's own."""
    with owned(opened.source, given):
        arrays, report = execute_plan(
            plan, opened.source, workers=options.workers or default_workers(opened.base),
            host_memory_budget=options.host_memory_budget, progress=options.progress, reshard=policy,
            host_ring_bytes=options.host_ring_bytes, device_hooks=options.device_hooks or "auto",
            read_ahead=options.read_ahead is not False, direct_io=options.direct_io is not False,
            collective_timeout=options.collective_timeout or DEFAULT_TIMEOUT_S,
        )
        loaded = Loaded(plan, opened.source, dict(arrays), report, model)
        for stage in (*stages, *plan_finishers(plan)):
            stage.finish(loaded)
        return loaded.arrays, report


@overload
def load_params(
    source: Location, abstract: Any, mapping: TableSpec, *, config: Mapping[str, Any] | None = None,
    options: LoadOptions | None = None, return_report: Literal[False] = False, **keywords: Unpack[ParamsKeywords],
) -> Any: ...


@overload
def load_params(
    source: Location, abstract: Any, mapping: TableSpec, *, config: Mapping[str, Any] | None = None,
    options: LoadOptions | None = None, return_report: Literal[True], **keywords: Unpack[ParamsKeywords],
) -> tuple[Any, LoadReport]: ...


def load_params(
    source: Location, abstract: Any, mapping: TableSpec, *, config: Mapping[str, Any] | None = None,
    options: LoadOptions | None = None, return_report: bool = False, **keywords: Unpack[ParamsKeywords],
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
    options, return_report, **keywords
        As for ``from_pretrained``, but for ``scan_layers`` and ``dtype``: the tree you bring fixes
        both (as keywords they are a ``TypeError``, in ``options`` they are not used), and
        ``merge_adapter=False`` needs the bundled models. With ``quantized="keep"`` every quantized
        leaf comes back as a ``QuantizedArray``.

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
    options = resolve_options(options, keywords, unused=MODEL_FIELDS)
    policy = resolve_policy(options.reshard)  # resolve_options took $OTFLOAD_RESHARD, checked
    start_first_transfers(jax.local_devices())  # an accelerator's one-time set-up, meanwhile
    target, plan, opened, stages = _plan_params(source, abstract, mapping, config, options)
    warn_replicated({path: p.leaf for path, p in plan.leaves.items()}, options.rules)  # once per load
    arrays, report = run_plan(plan, opened, source, options, policy, stages)
    tree = target.rebuild(arrays)
    return (tree, report) if return_report else tree


def plan_params(
    source: Location, abstract: Any, mapping: TableSpec, *, config: Mapping[str, Any] | None = None,
    options: LoadOptions | None = None, **keywords: Unpack[ParamsKeywords],
) -> LoadPlan:
    """What ``load_params`` would do, from the headers and ``config.json`` alone.

    Parameters
    ----------
    source, abstract, mapping, config, options, **keywords
        As for ``load_params`` (the options of the reads, ``workers``, ``host_memory_budget``,
        ``progress`` and ``reshard``, are not used).

    Returns
    -------
    LoadPlan
        Per leaf: the HF keys, hooks, stacking and sharding; no tensor byte is read.

    Raises
    ------
    CheckpointMismatchError, MeshRequiredError, SourceNotFoundError, AdapterError, InvalidOptionError
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
    options = resolve_options(options, keywords, unused=MODEL_FIELDS)
    _, plan, opened, _ = _plan_params(source, abstract, mapping, config, options)
    with owned(opened.source, source):  # nothing is read: closed now unless the caller passed it in
        return plan


def _plan_params(
    source: Location, abstract: Any, mapping: TableSpec, config: Mapping[str, Any] | None, options: LoadOptions
) -> tuple[Target, LoadPlan, Opened, tuple[Stage, ...]]:
    """The target, plan, opened checkpoint and stages of ``load_params``; on an error the source is
    closed unless it is ``source``. Kept LoRA factors are refused before anything is opened: they
    need a bundled model's forward pass."""
    asked = option_stages(options, bundled=False)
    opened = open_checkpoint(source, options, require_config=False)
    with ExitStack() as on_error:  # planning fails: close what this call opened
        on_error.enter_context(owned(opened.source, source))
        index = opened.index
        target, plan = plan_target(index, abstract, mapping, index.config if config is None else config,
                                   options.mesh, options.rules, options.strict)
        stages = (*opened.stages, *asked)
        plan = plan_stages(stages, dataclasses.replace(plan, config=index.config))
        on_error.pop_all()  # run_plan closes it
    return target, plan, opened, stages


def plan_target(
    index: CheckpointIndex, abstract: Any, mapping: TableSpec, config: Mapping[str, Any], mesh: Mesh | None,
    rules: LogicalRules | None, strict: bool,
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
