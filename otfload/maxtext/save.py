"""``export``: MaxText parameters back to an HF safetensors checkpoint, the load's table run
backwards (kernels transposed back, heads merged, RoPE halves and query scale undone, the
vocabulary padding cut off, the layer axis taken out at ``param_scan_axis``)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from otfload.errors import ConfigError
from otfload.export.companions import read_companions
from otfload.export.distributed import write_export
from otfload.export.gather import leaf_arrays
from otfload.export.job import ExportJob
from otfload.index.checkpoint import open_index
from otfload.maxtext.load import params_tree
from otfload.maxtext.selection import check_checkpoint, check_tree, select
from otfload.sources import Source
from otfload.sources.owned import owned_source


def export(
    params: Any,
    out_dir: str | os.PathLike[str],
    maxtext_config: Any,
    *,
    reference: str | os.PathLike[str] | Source,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> Path:
    """Write MaxText ``params`` (what :func:`~otfload.maxtext.load_state` returns, its ``"params"``
    tree, or an ``nnx.State``) as the HF checkpoint ``reference`` is.

    ``reference`` (the checkpoint the run started from) gives ``config.json``, the exact HF tensor
    shapes and the tokenizer and generation files written beside the weights; ``dtype`` ``None``
    keeps each leaf's dtype. The write is atomic, as ``otfload.export_hf``'s. The query scale of
    Llama 3.1 and Mixtral is divided out again: bit-exact where ``sqrt(head_dim)`` is a power of two,
    to the last bit of rounding otherwise. Raises :class:`ConfigError` as ``load_state`` does
    (naming the MaxText field), before anything is written.
    """
    selection = select(maxtext_config)
    arrays = leaf_arrays(params_tree(params))
    with owned_source(reference) as src:
        index = open_index(src, require_config=True)
        companions = read_companions(src)
    hf_config = dict(index.config)
    if not hf_config:
        raise ConfigError("config", None, "the reference checkpoint has no config.json", str(reference))
    config = selection.hook_config(check_checkpoint(selection, hf_config, str(reference)))
    check_tree(selection, {path: tuple(a.shape) for path, a in arrays.items()}, config)
    shapes = {key: info.shape for key, info in index.tensors.items()}
    job = ExportJob.build(arrays, {**hf_config, **config}, mapping=selection.mapping, hf_shapes=shapes, dtype=dtype)
    written = {k: v for k, v in job.config.items() if k in hf_config or k not in config}
    write_export(dataclasses.replace(job, config=written), arrays, out_dir, max_shard_size=max_shard_size,
                 overwrite=overwrite, companions=companions)
    return Path(out_dir)
