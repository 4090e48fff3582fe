"""LoRA factored (``merge_adapter=False``): the adapter's factors placed as their own parameters.

The adapter is merged into the checkpoint index exactly as for a merged load
(:func:`~otfload.adapters.merge.merge_adapters`: module names, experts, rank and alpha patterns are
resolved once, in one place), and the plan is built from it. :func:`factored_plan` then takes the LoRA
terms back out of the plan: every leaf reads its base tensors unchanged, and each adapted leaf
records, per stacked slice, the term (``A``, ``B``, rank, scale) of its base tensor.

Factor layout, from the leaf's reshape hooks (:func:`trace_layout`): the hooks that turn an HF
``[out, in]`` tensor into the kernel (reshapes, transposes, slices) are run on two index views of
that tensor, ``rows[o, i] = o`` and ``cols[o, i] = i`` (broadcast, no copy). A kernel dim along which
``rows`` varies comes from ``B``'s rows, one along which ``cols`` varies from ``A``'s columns; a dim
mixing both (a reshape merging out and in) has no factored form and is an
:class:`~otfload.errors.AdapterError`. The index arrays at ``0`` of the other dims say which row of
``B`` (column of ``A``) each kernel position takes: ``b = B[b_index]`` ``[*out_dims, r]`` and
``a = A[:, a_index]`` ``[r, *in_dims]``, so ``b ⊗_r a`` permuted to the kernel order is the merged
delta after the hooks, and export inverts the gathers exactly (each index is a permutation).

The factors are small (``r·(in + out)`` per module): each process reads them whole, once, and
places them with the base leaf's sharding on the matching dims (rank axis replicated). Slices of a
stacked leaf share the largest rank of the leaf (smaller ones zero-padded; see
:mod:`otfload.adapters.weight`).

What a factored adapter cannot be, each an :class:`~otfload.errors.AdapterError` naming the module:
several adapters at once (one at a time: swap with :func:`load_adapter`), ``modules_to_save``
(replacement tensors), a LoRA on a weight used outside the layer loop (embeddings, ``lm_head``),
PEFT's fused expert factors (``target_parameters`` on 3-D expert tensors) and transposed-expert
layouts, and a base tensor that feeds several leaves (a fused projection split by slices).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from otfload.adapters.config import CONFIG_FILE, AdapterConfig, parse_adapter_config
from otfload.adapters.merge import Adapter, check_adapted_are_mapped, is_adapted, merge_adapters
from otfload.adapters.source import CombinedSource, adapter_file
from otfload.adapters.tensor import AdaptedTensor, LoraTerm
from otfload.adapters.weight import KernelLayout, LoraWeight
from otfload.errors import AdapterError
from otfload.index.checkpoint import CheckpointIndex, read_json, read_values
from otfload.index.derived import DerivedTensor
from otfload.index.header import TensorInfo
from otfload.models.origin import origin_of
from otfload.plan.abstract import dotted
from otfload.plan.hooks import Hook, Reshape, Scale, Slice, Transpose
from otfload.plan.planner import LeafPlan, LoadPlan
from otfload.sources import Source
from otfload.sources.owned import owned

FACTOR_DTYPE = np.dtype(np.float32)  # trainable factors are stored in float32 whatever the base dtype
LAYOUT_HOOKS = (Reshape, Transpose, Slice)  # hooks that move elements only (traced on index views)
LORA_A_SUFFIX = ".lora_A.weight"
# A factored leaf's placed factors: ``(a, b, scale)``.
Factors = tuple[jax.Array, jax.Array, jax.Array]


@dataclass(frozen=True)
class SliceTerm:
    """The LoRA of one stacked slice: its factors, rank, scale and the module the adapter names."""

    module: str
    a: TensorInfo
    b: TensorInfo
    rank: int
    scale: float


@dataclass(frozen=True)
class FactoredLeaf:
    """An adapted leaf: its layout, the factor gathers and the term of each slice (None: not adapted)."""

    path: str
    layout: KernelLayout
    b_index: np.ndarray  # [*out_dims] rows of B
    a_index: np.ndarray  # [*in_dims] columns of A
    hook_scale: float  # product of the leaf's Scale hooks (they scale the delta as they scale the base)
    stack_shape: tuple[int, ...]
    sharding: NamedSharding
    terms: tuple[SliceTerm | None, ...]

    @property
    def rank(self) -> int:
        return max(t.rank for t in self.terms if t is not None)


def trace_layout(hooks: Sequence[Hook], shapes: Sequence[tuple[int, ...]], where: str
                 ) -> tuple[KernelLayout, np.ndarray, np.ndarray, float]:
    """``(layout, b_index, a_index, hook_scale)`` of a leaf built from 2-D ``[out, in]`` tensors
    through ``hooks`` (see the module docstring)."""
    source = tuple(shapes[0])
    if len(source) != 2:
        raise AdapterError(f"{where}: the base tensor is {list(source)}, not a 2-D [out, in] weight")
    rows0, cols0 = np.arange(source[0]), np.arange(source[1])
    rows, cols = np.broadcast_to(rows0[:, None], source), np.broadcast_to(cols0[None, :], source)
    hook_scale = 1.0
    for hook in hooks:
        if isinstance(hook, Scale):
            hook_scale *= float(hook.factor)
            continue
        if not isinstance(hook, LAYOUT_HOOKS):
            raise AdapterError(f"{where}: hook {hook!r} is not a reshape, transpose or slice; the factors "
                               "cannot follow it (merge the adapter instead)")
        rows, cols = hook.forward(rows), hook.forward(cols)
    shape = rows.shape
    views = np.may_share_memory(rows, rows0) and np.may_share_memory(cols, cols0)
    row_dims = {d for d, n in enumerate(shape) if n > 1 and rows.strides[d] != 0}
    col_dims = {d for d, n in enumerate(shape) if n > 1 and cols.strides[d] != 0}
    if not views or row_dims & col_dims:
        raise AdapterError(f"{where}: the hooks {list(hooks)} mix the output and input dims of the weight; "
                           "its LoRA factors have no kernel layout (merge the adapter instead)")
    out_dims = tuple(d for d in range(len(shape)) if d not in col_dims)
    in_dims = tuple(sorted(col_dims))
    b_index = rows[tuple(slice(None) if d in out_dims else 0 for d in range(len(shape)))]
    a_index = cols[tuple(slice(None) if d in in_dims else 0 for d in range(len(shape)))]
    for name, index, n in (("rows", b_index, source[0]), ("columns", a_index, source[1])):
        if index.size != n or not np.array_equal(np.sort(index, axis=None), np.arange(n)):
            raise AdapterError(f"{where}: the leaf takes only part of the weight's {name} (a fused projection "
                               "split between leaves); kept LoRA factors would be duplicated (merge instead)")
    return KernelLayout(out_dims, in_dims), np.array(b_index), np.array(a_index), hook_scale


def _slice_term(info: AdaptedTensor, path: str) -> SliceTerm:
    if len(info.terms) != 1:
        raise AdapterError(f"leaf {path!r}: tensor {info.name!r} has {len(info.terms)} LoRA terms; "
                           "merge_adapter=False keeps one adapter at a time")
    term: LoraTerm = info.terms[0]
    module = term.a.name.removesuffix(LORA_A_SUFFIX)
    where = f"leaf {path!r}: module {module!r}"
    if not term.a.name.endswith(LORA_A_SUFFIX):
        raise AdapterError(f"{where}: an embedding LoRA (lora_embedding_A/B) cannot be kept; merge it")
    if term.transposed or term.experts != 1 or term.expert is not None:
        raise AdapterError(f"{where}: PEFT's fused expert factors (target_parameters) cannot be kept yet; merge "
                           "them (merge_adapter=True) or use an adapter with one LoRA per expert module")
    return SliceTerm(module, term.a, term.b, term.rank, term.scale)


def factored_leaf(plan: LeafPlan) -> tuple[LeafPlan, FactoredLeaf | None]:
    """The leaf's plan reading its base tensors, and its factors (None when not adapted)."""
    adapted = [isinstance(s, AdaptedTensor) for s in plan.sources]
    for info in plan.sources:
        if is_adapted(info) and not isinstance(info, AdaptedTensor):
            raise AdapterError(f"leaf {plan.path!r}: the adapter replaces tensor {info.name!r} (modules_to_save); "
                               "replacement tensors cannot be kept separate (merge the adapter instead)")
    if not any(adapted):
        return plan, None
    if not plan.in_layer_stack:
        name = next(s.name for s in plan.sources if isinstance(s, AdaptedTensor))
        raise AdapterError(f"leaf {plan.path!r}: the adapter has a LoRA on {name!r}, a weight used outside the "
                           "layer loop (embedding, lm_head); it cannot be kept separate (merge the adapter)")
    if plan.layout is not None:
        raise AdapterError(f"leaf {plan.path!r}: its stack axes lie inside the leaf (stack_at {plan.stack_dims}); "
                           "kept LoRA factors stack leading (merge the adapter instead)")
    terms = tuple(_slice_term(s, plan.path) if isinstance(s, AdaptedTensor) else None for s in plan.sources)
    layout, b_index, a_index, hook_scale = trace_layout(plan.hooks, plan.shapes, f"leaf {plan.path!r}")
    sharding = plan.leaf.sharding
    if not isinstance(sharding, NamedSharding):
        raise AdapterError(f"leaf {plan.path!r}: its sharding {type(sharding).__name__} is not a NamedSharding; "
                           "kept LoRA factors are placed on the base leaf's mesh")
    bases = tuple(s.base if isinstance(s, AdaptedTensor) else s for s in plan.sources)
    factored = FactoredLeaf(plan.path, layout, b_index, a_index, hook_scale, tuple(plan.stack_shape), sharding, terms)
    return dataclasses.replace(plan, sources=bases), factored


def factored_plan(plan: LoadPlan) -> tuple[LoadPlan, dict[str, FactoredLeaf]]:
    """``plan`` reading every base tensor unmerged, and the factors of each adapted leaf."""
    leaves: dict[str, LeafPlan] = {}
    factored: dict[str, FactoredLeaf] = {}
    for path, leaf in plan.leaves.items():
        leaves[path], factors = factored_leaf(leaf)
        if factors is not None:
            factored[path] = factors
    used: dict[str, str] = {}
    for path, adapted in factored.items():
        for term in adapted.terms:
            if term is not None and used.setdefault(term.a.name, path) != path:
                raise AdapterError(f"module {term.module!r} feeds leaves {used[term.a.name]!r} and {path!r}; its "
                                   "kept factors would be duplicated (merge the adapter instead)")
    return dataclasses.replace(plan, leaves=leaves), factored


def require_merged(merge_adapter: bool) -> None:
    """``load_params`` merges: separate factors need a model whose forward pass applies them."""
    if not merge_adapter:
        raise AdapterError("merge_adapter=False is for the bundled models (from_pretrained): a model you bring "
                           "has no forward pass that applies kept LoRA factors; merge the adapter instead")


def _specs(leaf: FactoredLeaf) -> tuple[PartitionSpec, PartitionSpec]:
    """Shardings of ``a`` and ``b``: the base's stack dims, then its input (output) dims; rank replicated."""
    stack = len(leaf.stack_shape)
    spec = tuple(leaf.sharding.spec)
    spec = spec + (None,) * (stack + leaf.layout.ndim - len(spec))
    # jax leaves PartitionSpec.__init__ unannotated.
    a = PartitionSpec(*spec[:stack], None, *(spec[stack + d] for d in leaf.layout.in_dims))  # type: ignore[no-untyped-call]
    b = PartitionSpec(*spec[:stack], *(spec[stack + d] for d in leaf.layout.out_dims), None)  # type: ignore[no-untyped-call]
    return a, b


def _place(host: np.ndarray, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def place_factors(factored: Mapping[str, FactoredLeaf], source: Source) -> tuple[dict[str, Factors], int]:
    """``({path: (a, b, scale)}, bytes read)``: every factor read whole, gathered into the kernel
    layout, stacked and placed with the base leaf's sharding."""
    infos: dict[tuple[str, str], TensorInfo] = {}
    for leaf in factored.values():
        for term in leaf.terms:
            if term is not None:
                infos.setdefault((term.a.file, term.a.name), term.a)
                infos.setdefault((term.b.file, term.b.name), term.b)
    values = dict(zip(infos, read_values(source, list(infos.values())), strict=True))
    placed: dict[str, Factors] = {}
    for path, leaf in factored.items():
        r = leaf.rank
        a = np.zeros((*leaf.stack_shape, r, *leaf.a_index.shape), FACTOR_DTYPE)
        b = np.zeros((*leaf.stack_shape, *leaf.b_index.shape, r), FACTOR_DTYPE)
        scale = np.zeros(leaf.stack_shape, FACTOR_DTYPE)
        for i, term in enumerate(leaf.terms):
            if term is None:
                continue
            at = np.unravel_index(i, leaf.stack_shape) if leaf.stack_shape else ()
            a_full = values[(term.a.file, term.a.name)].astype(FACTOR_DTYPE)
            b_full = values[(term.b.file, term.b.name)].astype(FACTOR_DTYPE)
            a[at][: term.rank] = a_full[:, leaf.a_index]
            b[at][..., : term.rank] = b_full[leaf.b_index]
            scale[at] = term.scale * leaf.hook_scale
        mesh = leaf.sharding.mesh
        a_spec, b_spec = _specs(leaf)
        placed[path] = (_place(a, NamedSharding(mesh, a_spec)), _place(b, NamedSharding(mesh, b_spec)),
                        _place(scale, NamedSharding(mesh, PartitionSpec())))  # type: ignore[no-untyped-call]  # as in _specs
    return placed, sum(info.nbytes for info in infos.values())


# The attribute of a model loaded with ``merge_adapter=False`` holding its FactoredRecord.
RECORD_ATTRIBUTE = "otfload_lora"


@dataclass(eq=False)
class FactoredRecord:
    """What a model loaded with ``merge_adapter=False`` needs to swap or export its adapter: the
    plan of the base (headers only), the base's index, and the adapter now in place.

    The model carries it (a static attribute, :data:`RECORD_ATTRIBUTE`; it travels with
    ``nnx.split`` / ``nnx.merge``); compared and hashed by identity, as ``nnx.jit`` keys on it."""

    plan: LoadPlan
    index: CheckpointIndex
    adapter: AdapterConfig | None
    leaves: dict[str, FactoredLeaf]

    def __repr__(self) -> str:
        return f"FactoredRecord(adapter={self.adapter is not None}, leaves={len(self.leaves)})"


def factored_record(model: Any) -> FactoredRecord:
    """The record of a model loaded with ``merge_adapter=False`` (``AdapterError`` for any other)."""
    record = getattr(model, RECORD_ATTRIBUTE, None)
    if not isinstance(record, FactoredRecord):
        raise AdapterError("this model was not loaded with merge_adapter=False (from_pretrained(..., "
                           "merge_adapter=False)); it has no kept LoRA factors")
    return record


def _values(model: nnx.Module, paths: set[str], replace: Callable[[str, Any], Any]) -> None:
    state = nnx.state(model, nnx.Param)
    flat = [(path, var.replace(replace(dotted(path), var.get_value())) if dotted(path) in paths else var)
            for path, var in nnx.to_flat_state(state)]
    nnx.update(model, nnx.from_flat_state(flat))


def _install(model: nnx.Module, record: FactoredRecord, placed: Mapping[str, Factors]) -> None:
    """Put the factors in ``placed`` on the model's leaves; leaves adapted before and not now get
    their base back."""
    def value(path: str, current: Any) -> Any:
        base = current.base if isinstance(current, LoraWeight) else current
        if path not in placed:
            return base
        a, b, scale = placed[path]
        return LoraWeight(base, a, b, scale, record.leaves[path].layout)

    _values(model, set(record.leaves) | set(placed), value)


def wrap_arrays(arrays: dict[str, jax.Array], factored: Mapping[str, FactoredLeaf], placed: Mapping[str, Factors]
                ) -> dict[str, Any]:
    """The loaded leaf arrays with each factored leaf's base wrapped into its :class:`LoraWeight`."""
    out: dict[str, Any] = dict(arrays)
    for path, (a, b, scale) in placed.items():
        out[path] = LoraWeight(arrays[path], a, b, scale, factored[path].layout)
    return out


@dataclass
class FactoredLoad:
    """A ``merge_adapter=False`` load in progress: the plan of the base, the adapted leaves, their
    placed factors and the adapter's config (None without an adapter)."""

    plan: LoadPlan
    leaves: dict[str, FactoredLeaf]
    placed: dict[str, Factors]
    adapter: AdapterConfig | None
    bytes_read: int

    def finish(self, model: Any, arrays: dict[str, jax.Array], report: Any) -> dict[str, Any]:
        """The leaf values of ``model`` (factored leaves wrapped); gives ``model`` its record for
        :func:`load_adapter` and :func:`~otfload.adapters.export.export_adapter` and counts the factor
        bytes in ``report``."""
        origin = origin_of(model)
        tensors: dict[str, TensorInfo | DerivedTensor] = {
            info.name: info for leaf in self.plan.leaves.values() for info in leaf.sources
        }
        index = CheckpointIndex(source=None, config=dict(origin.config if origin else {}), tensors=tensors,
                                headers={})
        setattr(model, RECORD_ATTRIBUTE, FactoredRecord(self.plan, index, self.adapter, self.leaves))
        report.bytes_read += self.bytes_read
        return wrap_arrays(arrays, self.leaves, self.placed)


def adapter_config_of(source: Source) -> AdapterConfig | None:
    """The config of the (single) adapter of a combined source, None for a plain checkpoint."""
    if not isinstance(source, CombinedSource) or not source.adapters:
        return None
    if len(source.adapters) > 1:
        raise AdapterError(f"{len(source.adapters)} adapters with merge_adapter=False: kept LoRA factors are one "
                           "adapter at a time (merge the others, or swap with otfload.load_adapter)")
    where = source.adapters[0].description
    return parse_adapter_config(read_json(source, adapter_file(0, CONFIG_FILE)), where)


def prepare_factored(plan: LoadPlan, source: Source, given: object) -> FactoredLoad:
    """Take the LoRA terms out of ``plan`` (built on the merged index) and place the factors; on
    failure ``source`` is closed unless it is ``given`` (the caller's own)."""
    with ExitStack() as on_error:
        on_error.enter_context(owned(source, given))
        adapter = adapter_config_of(source)
        base_plan, factored = factored_plan(plan)
        placed, nbytes = place_factors(factored, source)
        on_error.pop_all()
    return FactoredLoad(base_plan, factored, placed, adapter, nbytes)


def load_adapter(
    model: nnx.Module, adapter: str | os.PathLike[str] | Source | None, **source_options: Any
) -> nnx.Module:
    """Replace the separate LoRA adapter of ``model`` (loaded with ``merge_adapter=False``) by ``adapter``
    (any location ``from_pretrained`` takes one from), or remove it (``None``); the base weights stay
    on the devices untouched. Returns ``model``, changed in place. ``source_options`` (``revision=``,
    ``token=``, ...) open the adapter."""
    from otfload.adapters.load import check_architecture, open_adapter_source, read_adapter

    record = factored_record(model)
    if adapter is None:
        _install(model, record, {})
        record.adapter, record.leaves = None, {}
        return model
    with owned(open_adapter_source(adapter, **source_options), adapter) as src:  # closed unless the caller's
        opened: Adapter = read_adapter(src, 0)
        check_architecture(opened.config, record.index.config)
        merged = merge_adapters(record.index, [opened])
        if merged.config.get("tie_word_embeddings") != record.index.config.get("tie_word_embeddings"):
            raise AdapterError(f"adapter {opened.where}: it adapts a tied embedding/head, which cannot be kept "
                               "separate (merge the adapter instead)")
        leaves = {path: dataclasses.replace(leaf, sources=tuple(merged.tensors[s.name] for s in leaf.sources))
                  for path, leaf in record.plan.leaves.items()}
        plan = dataclasses.replace(record.plan, leaves=leaves)
        check_adapted_are_mapped(plan, merged)
        _, factored = factored_plan(plan)
        placed, _ = place_factors(factored, CombinedSource(src, [src]))
    old = record.leaves
    record.leaves = {**old, **factored}  # old leaves stay known until their bases are restored
    _install(model, record, placed)
    record.adapter, record.leaves = opened.config, factored
    return model


__all__ = ["FactoredLeaf", "FactoredLoad", "FactoredRecord", "factored_plan", "factored_record", "load_adapter",
           "place_factors", "prepare_factored", "trace_layout", "wrap_arrays"]
