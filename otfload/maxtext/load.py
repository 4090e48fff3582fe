"""``load_state``: the drop-in for MaxText's ``load_safetensors_dynamic_state`` — the same
arguments, the same return value, otfload's engine underneath (each process reads only the bytes
its devices hold, straight into MaxText's layout; local directories, ``gs://``, ``s3://``, any
fsspec URL and Hub ids, with no copy to a bucket first)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Unpack

import jax
from flax import nnx

from otfload.api import load_params
from otfload.errors import ConfigError
from otfload.index.checkpoint import CONFIG_FILE, read_json
from otfload.maxtext.selection import Selection, check_checkpoint, check_tree, select
from otfload.options import MODEL_FIELDS, ParamsKeywords, resolve_options
from otfload.plan.abstract import dotted
from otfload.sources import Source
from otfload.sources.owned import owned_source

HUB_SCHEME = "hf://"  # MaxText's spelling of a Hub id; otfload reads the Hub by its id


def params_tree(abstract_params: Any) -> Any:
    """The weights' tree as MaxText's loader takes it: an ``nnx.State`` as its pure dict, a Linen
    ``{"params": ...}`` collection without the wrapper."""
    tree = abstract_params.to_pure_dict() if isinstance(abstract_params, nnx.State) else abstract_params
    if isinstance(tree, Mapping) and set(tree) == {"params"}:
        tree = tree["params"]
    return tree


def leaf_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Dotted leaf path → shape of a pytree of arrays or ``ShapeDtypeStruct`` s."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {dotted(path): tuple(leaf.shape) for path, leaf in flat}


def checked_config(
    selection: Selection, source: Source, location: str, leaves: Mapping[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The hook config of ``selection`` for the checkpoint in ``source``, after checking that its
    ``config.json`` and the tree ``leaves`` are the ones the MaxText config describes."""
    hf_config = read_json(source, CONFIG_FILE)
    if not isinstance(hf_config, dict):
        raise ConfigError("config", hf_config, "must be a JSON object", f"{location}/{CONFIG_FILE}")
    config = selection.hook_config(check_checkpoint(selection, hf_config, location))
    check_tree(selection, leaves, config)
    return config


def load_state(
    path: str | os.PathLike[str] | Source, abstract_params: Any, maxtext_config: Any,
    **keywords: Unpack[ParamsKeywords],
) -> tuple[None, dict[str, Any]]:
    """Load an HF safetensors checkpoint into MaxText's parameter tree.

    Parameters
    ----------
    path
        The checkpoint: a local directory, ``gs://`` / ``s3://`` / fsspec URL, or a Hub id (``hf://``
        as MaxText spells it, or plain); MaxText's ``load_parameters_path``.
    abstract_params
        MaxText's weights with no value allocated: the NNX params state (``nnx.State``) or Linen's
        ``params`` collection, ``jax.ShapeDtypeStruct`` s with their shardings.
    maxtext_config
        MaxText's config (``pyconfig`` ``HyperParameters``, or a mapping of the same fields): its
        ``model_name`` chooses the table, ``scan_layers`` and ``param_scan_axis`` the layout,
        ``vocab_size`` the padding, and ``emb_dim``, ``num_query_heads``, ``num_kv_heads``,
        ``head_dim``, ``mlp_dim``, ``num_decoder_layers`` (MoE: ``num_experts``, ``moe_mlp_dim``)
        resolve the hooks.
    **keywords
        ``otfload.load_params``' options (``token``, ``revision``, ``shard_cache``, ``workers``, ...).

    Returns
    -------
    tuple of (None, dict)
        ``(None, {"params": tree})`` as MaxText's ``load_safetensors_dynamic_state`` returns it: the
        tree as a nested dict of ``jax.Array`` s (an ``nnx.State`` given comes back as its pure dict).

    Raises
    ------
    ConfigError
        Before any tensor byte is read: a ``model_name`` with no table, a ``scan_layers``,
        ``param_scan_axis`` or ``vocab_size`` the tree or checkpoint does not fit, a tree or
        checkpoint of another model; the error's ``field`` is the MaxText field.
    CheckpointMismatchError, SourceNotFoundError, ...
        As ``otfload.load_params`` raises them.
    """
    selection = select(maxtext_config)
    tree = params_tree(abstract_params)
    options = resolve_options(None, dict(keywords), unused=MODEL_FIELDS)
    location = path
    if isinstance(location, str) and location.startswith(HUB_SCHEME):
        location = location[len(HUB_SCHEME):]
    with owned_source(location, **options.source_options()) as source:
        config = checked_config(selection, source, str(location), leaf_shapes(tree))
        params = load_params(source, tree, selection.mapping, config=config, options=options)
    return None, {"params": params}
