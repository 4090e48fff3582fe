"""PEFT LoRA adapters as a layer on an opened base checkpoint (the front door, :mod:`otfload.opening`,
opens the base and applies this layer).

An adapter is any location :func:`~otfload.sources.open_source` opens (local directory,
``pathlib.Path``, ``file://``/``gs://``/fsspec URL, Hub repo id, ``"org/name@revision"``, or a
:class:`~otfload.sources.Source`) holding ``adapter_config.json`` and ``adapter_model.safetensors``.
Only the config and the safetensors header are read here; the factors are read later, box by box,
through one :class:`~otfload.adapters.source.CombinedSource` over the base and every adapter
(:func:`add_adapters`).

A location holding an adapter and no ``config.json`` may be given as the checkpoint itself
(:func:`named_base`): the base is then ``base_model_name_or_path`` from its config (at its
``revision``, :func:`base_location`), opened with the same options.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otfload.adapters.config import CONFIG_FILE, WEIGHTS_FILE, AdapterConfig, parse_adapter_config
from otfload.adapters.merge import Adapter, merge_adapters, strip_prefix
from otfload.adapters.source import CombinedSource, adapter_file
from otfload.errors import AdapterError, CheckpointIndexError, SourceNotFoundError
from otfload.index.checkpoint import CONFIG_FILE as MODEL_CONFIG_FILE
from otfload.index.checkpoint import CheckpointIndex, read_json
from otfload.index.header import read_header
from otfload.sources import Source, open_source
from otfload.sources.checkpoint_files import check_safe_format

AdapterSpec = str | os.PathLike[str] | Source
# "org/name@revision": a Hub adapter at a revision (branch, tag or commit).
HUB_AT_REVISION = re.compile(r"^([\w.-]+/[\w.-]+)@([\w./-]+)$")
# A local base_model_name_or_path's config.json is read for its model_type; anything larger is not one.
MAX_LOCAL_CONFIG_BYTES = 1 << 20


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


def named_base(source: Source) -> Adapter | None:
    """The adapter ``source`` holds when it holds one and no model (a location given as the checkpoint
    itself: the base to load is the one its config names), else None."""
    if not is_adapter_source(source):
        return None
    adapter = read_adapter(source, 0)
    if adapter.config.base_model_name_or_path is None:
        raise AdapterError(f"adapter {adapter.where}: field base_model_name_or_path is not set: pass the base "
                           "checkpoint as the source and this adapter as adapter=")
    return adapter


def base_location(adapter: Adapter, options: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Where the base that ``adapter`` (from :func:`named_base`) names is, and the source options that
    open it: the call's, at the adapter's ``revision`` (the call's is the adapter's own)."""
    base = adapter.config.base_model_name_or_path
    assert base is not None  # named_base checked it
    base_options = {k: v for k, v in options.items() if k != "revision"}
    if adapter.config.revision:
        base_options["revision"] = adapter.config.revision
    return base, base_options


def base_not_found(adapter: Adapter, error: SourceNotFoundError) -> SourceNotFoundError:
    """The error for a base that ``adapter``'s config names and that cannot be opened."""
    base = adapter.config.base_model_name_or_path
    return SourceNotFoundError(
        f"adapter {adapter.where}: {CONFIG_FILE} names the base model base_model_name_or_path={base!r}, "
        f"which cannot be opened (a relative path is taken from the current directory, {Path.cwd()}, not "
        f"from the adapter's): {error}. Pass the base checkpoint as the source and this adapter as adapter=, "
        "or fix base_model_name_or_path"
    )


def add_adapters(
    base: Source, index: CheckpointIndex, adapters: Sequence[tuple[Source, Adapter]], owned: Sequence[Source]
) -> tuple[CombinedSource, CheckpointIndex]:
    """The adapter layer on an opened base: one source over ``base`` and every adapter's source
    (closing only ``owned``), and ``index`` with the adapters merged in, in order, each checked
    against the base's architecture first (with ``merge_adapter=False`` too:
    :mod:`otfload.adapters.factored` takes the terms back out of the plan)."""
    for _, adapter in adapters:
        check_architecture(adapter.config, index.config)
    merged = merge_adapters(index, [adapter for _, adapter in adapters])
    return CombinedSource(base, [source for source, _ in adapters], owned=owned), merged


__all__ = ["AdapterSpec", "add_adapters", "base_location", "base_not_found", "check_architecture",
           "is_adapter_source", "named_base", "open_adapter_source", "read_adapter"]
