"""``export_hf``: write a loaded model (or params pytree) back as a Hugging Face checkpoint."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from otfload.errors import ConfigError, MappingError
from otfload.export.companions import read_companions
from otfload.export.distributed import write_export
from otfload.export.gather import leaf_arrays
from otfload.export.job import ExportJob
from otfload.families.registry import Family
from otfload.index.checkpoint import CONFIG_FILE, open_index, read_json
from otfload.models.origin import origin_of
from otfload.options import LoadOptions, resolve_options
from otfload.plan.mapping import MappingTable, Rule
from otfload.sources import Source
from otfload.sources.owned import owned_source


def _reference(
    reference: str | os.PathLike[str] | Source | None,
) -> tuple[dict[str, Any] | None, dict[str, tuple[int, ...]] | None, dict[str, bytes]]:
    """``(config.json, {key: shape}, companion files)`` of the reference checkpoint: headers, the
    tokenizer and generation files, no tensor data."""
    if reference is None:
        return None, None, {}
    with owned_source(reference) as src:
        index = open_index(src, require_config=False)
        companions = read_companions(src)
    return index.config or None, {k: info.shape for k, info in index.tensors.items()}, companions


def load_config(config: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """An HF ``config.json``: given as a dict, or a path to the file or to its directory."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    name = CONFIG_FILE if path.is_dir() else path.name
    with owned_source(path if path.is_dir() else path.parent) as src:
        value = read_json(src, name)
    if not isinstance(value, dict):
        raise ConfigError("config", value, "must be a JSON object", file=str(path))
    return value


def export_hf(
    model_or_params: Any,
    out_dir: str | os.PathLike[str],
    *,
    config: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    reference: str | os.PathLike[str] | Source | None = None,
    family: str | Family[Any] | None = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str] | None = None,
    progress: bool | None = None,
) -> Path:
    """Write a model or parameter tree back as a Hugging Face safetensors checkpoint.

    The family's mapping table (or ``mapping``) is run backwards: every hook undone, stacked layers
    split, each HF tensor written with the shape the checkpoint had. The write is atomic (the
    directory appears whole or not at all); in a multi-process job every process calls it and
    writes its share of the files into the shared ``out_dir`` (see ``otfload.export.distributed``).

    Parameters
    ----------
    model_or_params
        An NNX model (its ``nnx.Param`` values) or a pytree of arrays; scanned or not, sharded or
        not.
    out_dir
        The directory to write; it must not exist unless ``overwrite`` is true.
    config
        The HF ``config.json``: a dict, or a path to the file or to its directory. Not needed for
        a model ``from_pretrained`` returned (it remembers its config and family) or with
        ``reference``.
    reference
        The checkpoint the model was loaded from (anything ``from_pretrained`` accepts). It gives
        the config, the exact HF tensor shapes (otherwise inferred from the mapping), and the
        tokenizer and generation files copied beside the weights (``tokenizer.json``,
        ``tokenizer_config.json``, ``generation_config.json``, ...: ``otfload.export.companions``).
    family
        The family whose table is inverted (default: from ``config["model_type"]``).
    dtype
        ``None`` keeps each leaf's dtype; ``"bf16"``, ``"f32"`` or a numpy dtype casts.
    max_shard_size
        The largest output file: bytes, or ``"5GB"``, ``"500MiB"``, ...
    overwrite
        Replace an existing ``out_dir``.
    mapping
        A mapping table for a model you bring, instead of a family's.
    progress
        A bar of the bytes written on stderr (default: when stderr is a terminal, as the load's).

    Returns
    -------
    Path
        ``out_dir``. A quantized source's ``quantization_config`` is dropped: the weights written
        are the dequantised ones.

    Raises
    ------
    MappingError
        No config for a tree otfload did not build, or a leaf the table cannot place.
    OutputExistsError
        ``out_dir`` exists and ``overwrite`` is false.

    Examples
    --------
    >>> import otfload
    >>> model = otfload.from_pretrained("./tiny-llama")
    >>> otfload.export_hf(model, "./tiny-llama-bf16", reference="./tiny-llama", dtype="bf16")
    PosixPath('tiny-llama-bf16')
    """
    ref_config, hf_shapes, companions = _reference(reference)
    origin = origin_of(model_or_params)
    if config is not None:
        hf_config = load_config(config)
    elif ref_config is not None:
        hf_config = ref_config
    elif origin is not None:
        hf_config = origin.config
    else:
        raise MappingError("export_hf needs the HF config for a model otfload did not build: "
                           "pass config= (dict or config.json path) or reference=")
    arrays = leaf_arrays(model_or_params)
    job = ExportJob.build(arrays, hf_config, family=family, mapping=mapping, hf_shapes=hf_shapes, dtype=dtype)
    write_export(job, arrays, out_dir, max_shard_size=max_shard_size, overwrite=overwrite, companions=companions,
                 progress=progress)
    return Path(out_dir)


def export_checkpoint(
    source: str | os.PathLike[str] | Source,
    out_dir: str | os.PathLike[str],
    *,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    options: LoadOptions | None = None,
    **keywords: Any,  # LoadKeywords but dtype, the one written here (the load's: options.dtype)
) -> Path:
    """What ``otfload export SRC OUT`` runs: load the HF checkpoint ``source`` with
    ``otfload.from_pretrained`` (``options`` and ``keywords`` are its own: ``mesh``, ``scan_layers``,
    ``adapter``, ``revision``, ...; ``dtype`` here is the one written) and write it back with
    ``export_hf``, using ``source`` as the reference (config, shapes, tokenizer and generation files).
    The load's ``progress`` option shows the write's bar too."""
    from otfload.api import from_pretrained

    load_options = resolve_options(options, keywords)
    with owned_source(source, **load_options.source_options()) as src:  # one opening for the load and the reference
        model = from_pretrained(src, options=load_options)
        return export_hf(model, out_dir, reference=src, dtype=dtype, max_shard_size=max_shard_size,
                         overwrite=overwrite, progress=load_options.progress)
