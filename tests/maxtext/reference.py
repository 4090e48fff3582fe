"""MaxText's side of the MaxText tests (the MaxText venv only): its config and abstract NNX model for a
tiny family, its own on-the-fly loader (``load_safetensors_dynamic_state``) and its forward pass.

MaxText's loader derives its key map and hooks from
``hf_model_configs.HF_MODEL_CONFIGS[model_name]``, a transformers config of the real model's size;
``maxtext_load`` points that entry at the tiny checkpoint's own ``config.json`` first.

Where that loader cannot load at all (GPT-OSS: ``transform_hf_state_to_mt_state`` calls
``str.replace`` on the converter's composite ``(wi_0, wi_1)`` keys, an ``AttributeError``),
``maxtext_convert`` is the reference: the per-leaf steps of MaxText's offline converter
(``to_maxtext``: the same mapping and hooks, its stacking, composite keys split on the last axis;
the vision encoder's leaves, which a text-only tree has not, skipped: Gemma 4's mapping lists them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import transformers
from flax import nnx
from flax.linen import partitioning as nn_partitioning
from maxtext.checkpoint_conversion import to_maxtext
from maxtext.checkpoint_conversion.utils import hf_model_configs, load_dynamic, param_mapping
from maxtext.common import checkpointing
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils
from safetensors.numpy import load_file

from tests.maxtext.models import Family

# 2 x 4 of the 8 simulated devices: embed over fsdp, heads / mlp / vocab over tensor.
MESH = dict(ici_fsdp_parallelism=2, ici_tensor_parallelism=4)
# float32 activations and exact matmuls, so the logits compare with transformers' f32 ones; MaxText's MoE
# without its sparse (ragged) kernels compiles 3x faster on CPU and gives the same numbers.
NUMERICS = dict(dtype="float32", matmul_precision="highest", sparse_matmul=False)


@dataclass
class Built:
    """A MaxText config, its model's constructor, and the abstract model and weights it builds."""

    config: Any
    create: Any
    model: nnx.Module
    params: nnx.State

    @property
    def mesh(self) -> jax.sharding.Mesh:
        return self.model.mesh


def build(family: Family, scan_layers: bool, param_scan_axis: int) -> Built:
    """MaxText's config and abstract NNX model of ``family`` in one layout, on 8 CPU devices."""
    # jax_cache_dir "": MaxText leaves XLA's cache as the tests' conftest set it (else ``~/jax_cache``)
    config = pyconfig.initialize([""], hardware="cpu", attention="dot_product", skip_jax_distributed_system=True,
                                 jax_cache_dir="", **MESH, **NUMERICS,
                                 **family.maxtext_kwargs(scan_layers, param_scan_axis))
    create, model = model_creation_utils.create_nnx_abstract_model(config)
    # the weights MaxText's checkpointing hands its loader: every variable but RNG, cache and
    # intermediates (DeepSeek-V3's routing bias is a MoEBiasVar, no nnx.Param)
    return Built(config, create, model, checkpointing._abstract_params(nnx.state(model)))


def _tiny_hf_config(built: Built, path: Path) -> Any:
    """Point MaxText's HF config of ``built``'s model at the tiny checkpoint's ``config.json``; returns it."""
    hf_config = getattr(transformers, type(hf_model_configs.HF_MODEL_CONFIGS[built.config.model_name]).__name__)
    hf_model_configs.HF_MODEL_CONFIGS[built.config.model_name] = hf_config.from_pretrained(path)
    return hf_model_configs.HF_MODEL_CONFIGS[built.config.model_name]


def maxtext_load(built: Built, path: Path) -> dict[str, Any]:
    """MaxText's own loader on ``path``: its ``{"params": tree}``, with the tiny HF config in place."""
    _tiny_hf_config(built, path)
    restored, tree = load_dynamic.load_safetensors_dynamic_state(str(path), built.params, built.config)
    assert restored is None
    return tree


def maxtext_convert(built: Built, path: Path) -> dict[str, Any]:
    """MaxText's offline converter's ``{"params": tree}`` (numpy leaves) for ``path``, step by step
    as ``to_maxtext.main`` takes them, in memory and in float32."""
    config, name = built.config, built.config.model_name
    hf_config = _tiny_hf_config(built, path).to_dict()
    mapping = param_mapping.PARAM_MAPPING[name](hf_config, config, config.scan_layers)
    hooks = param_mapping.HOOK_FNS[name](hf_config, config, config.scan_layers, saving_to_hf=False)
    leaves = flat(built.params)
    paths = list(leaves)
    shapes = {"params-" + p.replace(".", "-"): (i, leaves[p].shape) for i, p in enumerate(paths)}
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    weights: list[Any] = [None] * len(paths)
    for keys, source in mapping.items():
        if isinstance(keys, str) and keys.startswith("params-vision_encoder-") and keys not in shapes:
            continue  # the vision encoder of a multimodal checkpoint (Gemma 4's), not in a text-only tree
        index, shape = to_maxtext._get_maxtext_indices_and_shapes(keys, shapes)
        load = to_maxtext._get_hf_loading_function(source, tensors.__getitem__, hooks.get(keys), shape, config, keys)
        to_maxtext._get_maxtext_weight(load, index, shape, keys, weights, "float32", False)
    converted = {p: np.asarray(w) for p, w in zip(paths, weights, strict=True)}
    return {"params": flax.traverse_util.unflatten_dict(converted, sep=".")}


def flat(tree: Any) -> dict[str, Any]:
    """A loader's tree (pure dict or ``nnx.State``) as ``{"decoder.layers.mlp.wo.kernel": leaf}``."""
    if isinstance(tree, nnx.State):
        tree = tree.to_pure_dict()
    return flax.traverse_util.flatten_dict(tree, sep=".")


def logits(built: Built, tree: dict[str, Any], ids: np.ndarray) -> np.ndarray:
    """MaxText's forward pass (its ``Transformer.__call__``) with the weights of ``tree``, f32 logits."""
    state = checkpointing._abstract_params(nnx.state(built.model))
    nnx.replace_by_pure_dict(state, tree["params"])
    with jax.set_mesh(built.mesh), nn_partitioning.axis_rules(built.config.logical_axis_rules):
        model = built.create()  # a concrete model: the abstract one's RNG state is shapes only
        nnx.update(model, state)
        tokens = jnp.asarray(ids, jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(ids.shape[1], dtype=jnp.int32), ids.shape)
        out = _forward(model, tokens, positions)
    return np.asarray(out, np.float32)


@nnx.jit
def _forward(model: nnx.Module, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """One compiled program for the whole call (op by op, the tiny model's forward takes 3x longer)."""
    return model(decoder_input_tokens=tokens, decoder_positions=positions, decoder_segment_ids=jnp.ones_like(tokens),
                 enable_dropout=False)
