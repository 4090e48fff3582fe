"""Open a base checkpoint with PEFT LoRA adapters merged into its index.

An adapter is any location :func:`~otfload.sources.open_source` opens (local directory,
``pathlib.Path``, ``file://``/``gs://``/fsspec URL, Hub repo id, ``"org/name@revision"``, or a
:class:`~otfload.sources.Source`) holding ``adapter_config.json`` and ``adapter_model.safetensors``.
Only the config and the safetensors header are read here; the factors are read later, box by box,
through one :class:`~otfload.adapters.source.CombinedSource` over the base and every adapter.

A location holding an adapter and no ``config.json`` may be given as the checkpoint itself: the base
is then ``base_model_name_or_path`` from its config (at its ``revision``), opened with the same
options.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from otfload.adapters.config import CONFIG_FILE, WEIGHTS_FILE, AdapterConfig, parse_adapter_config
from otfload.adapters.merge import Adapter, merge_adapters, strip_prefix
from otfload.adapters.source import CombinedSource, adapter_file
from otfload.errors import AdapterError, CheckpointIndexError, SourceNotFoundError
from otfload.index.checkpoint import CONFIG_FILE as MODEL_CONFIG_FILE
from otfload.index.checkpoint import CheckpointIndex, open_index, read_json
from otfload.index.header import read_header
from otfload.sources import Source, open_source
from otfload.sources.checkpoint_files import check_safe_format
from otfload.sources.owned import is_owned

AdapterSpec = str | os.PathLike[str] | Source
# "org/name@revision": a Hub adapter at a revision (branch, tag or commit).
HUB_AT_REVISION = re.compile(r"^([\w.-]+/[\w.-]+)@([\w./-]+)$")
# A local base_model_name_or_path's config.json is read for its model_type; anything larger is not one.
MAX_LOCAL_CONFIG_BYTES = 1 << 20


def adapter_specs(adapter: AdapterSpec | Sequence[AdapterSpec] | None) -> list[AdapterSpec]:
    """``adapter=`` as a list (in the order the adapters apply)."""
    if adapter is None:
        return []
    if isinstance(adapter, (str, os.PathLike, Source)):
        return [adapter]
    if isinstance(adapter, Sequence) and all(isinstance(a, (str, os.PathLike, Source)) for a in adapter):
        return list(adapter)
    raise TypeError(f"adapter= must be a location, a Source or a list of them, not {adapter!r}")


def open_adapter_source(spec: AdapterSpec, **options: Any) -> Source:
    """Open one adapter location; ``revision`` in ``options`` is the base's and is not passed on."""
    options = {k: v for k, v in options.items() if k != "revision"}
    if isinstance(spec, Source):
        return spec
    text = os.fspath(spec)
    match = HUB_AT_REVISION.match(text)
    if match and not Path(text).expanduser().exists():
        return open_source(match[1], revision=match[2], **options)
    return open_source(spec, **options)


def is_adapter_source(source: Source) -> bool:
    """Whether ``source`` holds an adapter and no model (``adapter_config.json``, no ``config.json``)."""
    files = set(source.list_files())
    return CONFIG_FILE in files and MODEL_CONFIG_FILE not in files


def read_adapter(source: Source, index: int) -> Adapter:
    """The config and tensor headers of the adapter in ``source`` (number ``index`` in the load)."""
    where = source.description
    files = set(source.list_files())
    if CONFIG_FILE not in files:
        raise AdapterError(f"adapter {where}: no {CONFIG_FILE} (not a PEFT adapter)")
    if WEIGHTS_FILE not in files:
        check_safe_format(files, f"adapter {where}")  # adapter_model.bin only: UnsafeFormatError
        raise AdapterError(f"adapter {where}: no {WEIGHTS_FILE}")
    try:
        config = parse_adapter_config(read_json(source, CONFIG_FILE), where)
    except CheckpointIndexError as e:
        raise AdapterError(f"adapter {where}: {e}") from None
    header = read_header(source, WEIGHTS_FILE)
    tensors = {}
    for key, info in header.tensors.items():
        name = strip_prefix(key)
        if name in tensors:
            raise AdapterError(f"adapter {where}: tensor {name!r} is stored twice (with and without the PEFT prefix)")
        tensors[name] = info._replace(name=name, file=adapter_file(index, info.file))
    if not tensors:
        raise AdapterError(f"adapter {where}: {WEIGHTS_FILE} holds no tensors")
    return Adapter(index, where, config, tensors)


def _local_model_type(path: str) -> str | None:
    """``model_type`` of a local directory's config.json, or None when there is none to read."""
    config = Path(path).expanduser() / MODEL_CONFIG_FILE
    try:
        if not config.is_file() or config.stat().st_size > MAX_LOCAL_CONFIG_BYTES:
            return None
        value = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def check_architecture(config: AdapterConfig, base_config: Mapping[str, Any]) -> None:
    """Raise if the adapter says it was made for another architecture than the base's."""
    architectures = base_config.get("architectures")
    cls = config.base_model_class
    if cls and isinstance(architectures, list) and architectures and cls not in architectures:
        raise AdapterError(f"adapter {config.where}: field auto_mapping.base_model_class is {cls!r}, but the base "
                           f"checkpoint is {architectures}: the adapter was made for another architecture")
    name = config.base_model_name_or_path
    model_type = base_config.get("model_type")
    theirs = _local_model_type(name) if name else None
    if theirs and model_type and theirs != model_type:
        raise AdapterError(f"adapter {config.where}: field base_model_name_or_path {name!r} is a {theirs!r} model, "
                           f"but the base checkpoint is {model_type!r}: the adapter was made for another architecture")


def open_adapted(
    source: str | os.PathLike[str] | Source,
    adapter: AdapterSpec | Sequence[AdapterSpec] | None,
    open_base: Callable[..., Source],
    *,
    merge_adapter: bool = True,
    require_config: bool = True,
    check_config: Callable[[dict[str, Any]], object] | None = None,
    **options: Any,
) -> tuple[Source, CheckpointIndex, bool]:
    """``(source, index, owned)``: the base checkpoint's source and index with ``adapter`` merged in
    (with ``merge_adapter=False`` too: :mod:`otfload.adapters.kept` takes the terms back out of the plan).

    ``open_base(location, **options)`` opens a base checkpoint (the API's source and cache options);
    ``check_config`` goes to :func:`~otfload.index.checkpoint.open_index` (the family lookup).
    With adapters the source is a :class:`CombinedSource` (``owned``: the caller closes it; it closes
    only what was opened here). Without any, it is the base's source, ``owned`` unless it *is* the
    :class:`Source` the caller passed (a shard cache ``open_base`` put around that one is owned).
    Ownership follows :func:`otfload.sources.owned.is_owned`; on an error everything opened here is
    closed again.
    """
    specs = adapter_specs(adapter)
    if not merge_adapter and len(specs) > 1:
        raise AdapterError(f"{len(specs)} adapters with merge_adapter=False: kept LoRA factors are one adapter at a "
                           "time (merge them, or swap adapters with otfload.load_adapter)")
    opened: list[Source] = []
    try:
        src = open_base(source, **options)
        if is_owned(src, source):  # opened here, or a cache around the caller's source
            opened.append(src)
        first: tuple[Source, Adapter] | None = None  # the source itself is an adapter (and names its base)
        if not specs and is_adapter_source(src):
            first = (src, read_adapter(src, 0))
            config = first[1].config
            base = config.base_model_name_or_path
            if base is None:
                raise AdapterError(f"adapter {config.where}: field base_model_name_or_path is not set: pass the "
                                   "base checkpoint as the source and this adapter as adapter=")
            specs = [src]
            base_options = {k: v for k, v in options.items() if k != "revision"}
            if config.revision:
                base_options["revision"] = config.revision
            try:
                src = open_base(base, **base_options)
            except SourceNotFoundError as e:
                raise SourceNotFoundError(
                    f"adapter {config.where}: {CONFIG_FILE} names the base model base_model_name_or_path={base!r}, "
                    f"which cannot be opened (a relative path is taken from the current directory, "
                    f"{Path.cwd()}, not from the adapter's): {e}. Pass the base checkpoint as the source and "
                    "this adapter as adapter=, or fix base_model_name_or_path"
                ) from None
            opened.append(src)
        index = open_index(src, require_config=require_config, check_config=check_config)
        if not specs:
            return src, index, is_owned(src, source)
        sources: list[Source] = []
        adapters: list[Adapter] = []
        for i, spec in enumerate(specs):
            if first is not None and i == 0:  # read above, through a source already in ``opened`` if owned
                sources.append(first[0])
                adapters.append(first[1])
                continue
            adapter_src = open_adapter_source(spec, **options)
            if is_owned(adapter_src, spec):
                opened.append(adapter_src)
            sources.append(adapter_src)
            adapters.append(read_adapter(adapter_src, i))
        for one in adapters:
            check_architecture(one.config, index.config)
        merged = merge_adapters(index, adapters)
        return CombinedSource(src, sources, owned=opened), merged, True
    except BaseException:
        for opened_source in reversed(opened):
            with contextlib.suppress(Exception):  # the original error matters more
                opened_source.close()
        raise


__all__ = ["AdapterSpec", "adapter_specs", "check_architecture", "is_adapter_source", "open_adapted",
           "open_adapter_source", "read_adapter"]
