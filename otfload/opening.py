"""The front door of every load: a checkpoint location opened in one place.

:func:`open_checkpoint` opens the location (:func:`~otfload.sources.open_source` with the options'
source options), puts the shard cache in front of it when the options ask
(:func:`~otfload.cache.wrap_with_cache`) and reads its index (``config.json`` and every safetensors
header). PEFT LoRA adapters are a layer on that opened base (:mod:`otfload.adapters.load`), a stage run only
when the options name an adapter or the location holds one (:mod:`otfload.stages.adapters`): each
adapter location is opened and its header read, and :func:`~otfload.adapters.load.add_adapters`
gives one source over the base and the adapters and the index with their terms merged in. A
location holding an adapter and no model stands for the base its config names, opened here the
same way (source options, shard cache) at the adapter's revision, with that adapter on top.

Who closes what follows :mod:`otfload.sources.owned`: :attr:`Opened.source` is the caller's to close
unless it *is* the ``Source`` the caller passed in; on an error everything opened here is closed again.

What the base checkpoint says about the load's defaults is here too: :func:`storage_dtype` (a bundled
model's parameter dtype) and :func:`default_workers` (builder threads), both of the base, whatever
adapters lie on it.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import ml_dtypes
import numpy as np

from otfload.cache import wrap_with_cache
from otfload.errors import SourceNotFoundError
from otfload.index.checkpoint import CheckpointIndex, open_index
from otfload.index.derived import is_derived
from otfload.options import LoadOptions
from otfload.options.environment import environment
from otfload.place.loader import ACCELERATOR_WORKERS, DEFAULT_WORKERS, REMOTE_WORKERS
from otfload.sources import LocalSource, Source, open_source
from otfload.sources.owned import is_owned, owned
from otfload.stages import Stage
from otfload.stages.adapters import AdapterOverlay, holds_adapter

if TYPE_CHECKING:
    from otfload.adapters.merge import Adapter


@dataclass(frozen=True)
class Opened:
    """A checkpoint opened for a load. ``source`` and ``index`` are what the plan and the reads use
    (the adapter layer included); ``base`` and ``base_index`` are the checkpoint beneath any adapter
    (its storage dtype, the number of builder threads its kind of source wants). ``stages`` is the
    overlay applied here (:class:`~otfload.stages.adapters.AdapterOverlay`; none for a plain
    checkpoint), whose plan transform the plan runs through."""

    source: Source
    index: CheckpointIndex
    base: Source
    base_index: CheckpointIndex
    stages: tuple[Stage, ...] = ()


def open_cached(location: str | os.PathLike[str] | Source, options: LoadOptions,
                source_options: Mapping[str, Any]) -> Source:
    """``location`` opened with ``source_options``, with the shard cache of ``options`` in front when
    it asks for one. The cache owns the source only if it was opened here; that one is closed again
    if the cache fails."""
    with ExitStack() as on_error:
        src = on_error.enter_context(owned(open_source(location, **source_options), location))
        cached = wrap_with_cache(src, options.shard_cache, storage_options=options.shard_cache_options,
                                 verify=options.verify, owns_source=is_owned(src, location),
                                 local_dir=environment().local_cache_dir if options.shard_cache is True else None)
        on_error.pop_all()  # success: the caller owns ``cached``
    return cached


def open_checkpoint(
    location: str | os.PathLike[str] | Source,
    options: LoadOptions,
    *,
    require_config: bool = True,
    check_config: Callable[[dict[str, Any]], object] | None = None,
) -> Opened:
    """The checkpoint at ``location`` with ``options``' adapters on it; ``require_config`` and
    ``check_config`` (the family lookup) go to :func:`~otfload.index.checkpoint.open_index`."""
    source_options = options.source_options()
    opened: list[Source] = []  # what this call opened (or wrapped), closed again on an error
    try:
        source = base = _track(open_cached(location, options, source_options), location, opened)
        if not options.adapters and not holds_adapter(source):  # a plain checkpoint: no adapter code runs
            index = open_index(base, require_config=require_config, check_config=check_config)
            return Opened(base, index, base, index)
        from otfload.adapters.load import (
            add_adapters,
            base_location,
            base_not_found,
            named_base,
            open_adapter_source,
            read_adapter,
        )

        adapters: list[tuple[Source, Adapter]] = []  # (its source, its config and headers), in order
        named = None if options.adapters else named_base(source)
        if named is not None:  # the location is an adapter: the base is the one its config names
            adapters.append((source, named))
            where, base_options = base_location(named, source_options)
            try:
                base = _track(open_cached(where, options, base_options), where, opened)
            except SourceNotFoundError as e:
                raise base_not_found(named, e) from None
        index = open_index(base, require_config=require_config, check_config=check_config)
        for i, spec in enumerate(options.adapters):
            adapter_source = _track(open_adapter_source(spec, **source_options), spec, opened)
            adapters.append((adapter_source, read_adapter(adapter_source, i)))
        combined, merged = add_adapters(base, index, adapters, owned=opened)
        return Opened(combined, merged, base, index, (AdapterOverlay(merged),))
    except BaseException:
        for one in reversed(opened):
            with contextlib.suppress(Exception):  # the original error matters more
                one.close()
        raise


def _track(source: Source, given: object, opened: list[Source]) -> Source:
    """``source``, added to ``opened`` when the call owns it (it is not ``given``, the caller's own)."""
    if is_owned(source, given):
        opened.append(source)
    return source


def storage_dtype(index: CheckpointIndex) -> np.dtype[Any]:
    """The dtype holding most of the checkpoint's floating-point bytes; quantized weights count as
    bf16, the dtype they were trained in. Given the base's index (:attr:`Opened.base_index`), a
    weight with adapters merged in counts as its base."""
    weights: Counter[np.dtype[Any]] = Counter()
    for info in index.tensors.values():
        if is_derived(info):
            weights[np.dtype(ml_dtypes.bfloat16)] += 2 * math.prod(info.shape)
        elif np.issubdtype(info.dtype, np.floating) or info.dtype.kind == "V":
            weights[info.dtype] += info.nbytes
    if not weights:
        return np.dtype(np.float32)
    dtype: np.dtype[Any] = weights.most_common(1)[0][0]
    return dtype


def default_workers(source: Source, devices: Sequence[Any] | None = None) -> int:
    """Builder threads for reads from ``source`` (the base, :attr:`Opened.base`: its bytes dominate):
    few for local files onto CPU devices (CPU-bound), more for remote ones (latency-bound) and for
    local files onto accelerators (one copy per byte, spread over the CPUs)."""
    if not isinstance(source, LocalSource):
        return REMOTE_WORKERS
    devices = jax.local_devices() if devices is None else devices
    if any(d.platform != "cpu" for d in devices):
        return max(DEFAULT_WORKERS, min(ACCELERATOR_WORKERS, (os.cpu_count() or 1) // 2))
    return DEFAULT_WORKERS


__all__ = ["Opened", "default_workers", "open_cached", "open_checkpoint", "storage_dtype"]
