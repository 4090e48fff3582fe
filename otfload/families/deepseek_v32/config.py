"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``) configs: the MLA fields as DeepSeek-V3
reads them (:class:`~otfload.families.mla.MlaConfig`) plus the DSA indexer's, checked against what
transformers 5.24 builds.

Both families run the indexer on every layer (``layer_types`` all ``"indexed_attention"``); the
main attention always rotates interleaved pairs; the indexer rotates rotate-half (DeepSeek-V3.2) or
interleaved pairs (GLM-5). GLM-5's ``indexer_types`` (or ``index_topk_pattern`` /
``index_topk_freq`` / ``index_skip_topk_offset``, from which transformers derives it) may mark
layers ``"shared"`` (reusing the previous full layer's selection): not implemented, so refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from otfload.config import BOOL, HEAD_DIM, HEADS, LAYERS, WINDOW, Choice, Fields, Int, List, Str, require
from otfload.config.fields import MAX_LAYERS
from otfload.errors import ConfigError
from otfload.families.mla import MlaConfig

DEEPSEEK_V32, GLM_MOE_DSA = "deepseek_v32", "glm_moe_dsa"
# transformers' defaults per model type: index_n_heads, and whether the indexer's RoPE is interleaved.
INDEX_HEADS = {DEEPSEEK_V32: 64, GLM_MOE_DSA: 32}
INDEXER_INTERLEAVED = {DEEPSEEK_V32: False, GLM_MOE_DSA: True}
INDEX_TOPK, INDEX_HEAD_DIM = 2048, 128
FULL, SHARED = "full", "shared"
INDEXER_TYPES = List(Choice(FULL, SHARED))
LAYER_TYPES = List(Choice("indexed_attention"))
MLP_LAYER_TYPES = List(Choice("dense", "sparse"))
PATTERN = {"F": FULL, "S": SHARED}
OFFSET = Int(-MAX_LAYERS, MAX_LAYERS)


def _indexer_types(f: Fields, layers: int) -> tuple[str, tuple[str, ...]]:
    """``(field it comes from, per-layer indexer type)``, derived as transformers' GLM-5 config does."""
    if f.has("indexer_types"):
        return "indexer_types", f.get("indexer_types", INDEXER_TYPES)
    if f.has("index_topk_pattern"):
        pattern = f.get("index_topk_pattern", Str(MAX_LAYERS))
        for i, c in enumerate(pattern):
            if c not in PATTERN:
                raise ConfigError(f"index_topk_pattern[{i}]", c, "one of 'F' (full) or 'S' (shared)")
        return "index_topk_pattern", tuple(PATTERN[c] for c in pattern)
    freq = max(f.get("index_topk_freq", Int(0, MAX_LAYERS), 1), 1)
    offset = f.get("index_skip_topk_offset", OFFSET, 2)
    return "index_topk_freq", tuple(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(layers))


def dsa_config(hf: Mapping[str, Any]) -> MlaConfig:
    """Parse and check a DeepSeek-V3.2 or GLM-5 ``config.json`` (absent fields: transformers' defaults)."""
    f = Fields(hf)
    model_type = f.get("model_type", Choice(DEEPSEEK_V32, GLM_MOE_DSA))
    cfg = MlaConfig.from_hf(hf)
    require(cfg.q_lora_rank is not None, "q_lora_rank", None, "is required: the DSA indexer reads the query latent")
    if not cfg.rope_interleave:
        raise ConfigError("rope_interleave", False, f"{model_type} always rotates interleaved pairs (as transformers)")
    interleaved = INDEXER_INTERLEAVED[model_type]
    if f.get("indexer_rope_interleave", BOOL, interleaved) != interleaved:
        raise ConfigError("indexer_rope_interleave", not interleaved,
                          f"{model_type}'s indexer rotates {'interleaved pairs' if interleaved else 'rotate-half'}")
    layers = f.get("num_hidden_layers", LAYERS)
    types = f.get("layer_types", LAYER_TYPES, None)
    require(types is None or len(types) == layers, "layer_types", types, f"must list {layers} layers")
    mlp = f.get("mlp_layer_types", MLP_LAYER_TYPES, None)
    expected = ("dense",) * cfg.first_k_dense_replace + ("sparse",) * cfg.num_moe_layers
    require(mlp is None or mlp == expected, "mlp_layer_types", mlp,
            f"must be first_k_dense_replace ({cfg.first_k_dense_replace}) 'dense' layers, then 'sparse' ones")
    field, indexers = _indexer_types(f, layers)
    require(len(indexers) == layers, field, indexers, f"must give {layers} layers")
    if SHARED in indexers:
        raise ConfigError(field, f.data.get(field),
                          f"gives 'shared' indexer layers (layer {indexers.index(SHARED)}), which reuse another "
                          "layer's selection: not supported, every layer must run its own indexer ('full')")
    head_dim = f.get("index_head_dim", HEAD_DIM, INDEX_HEAD_DIM)
    require(head_dim >= cfg.qk_rope_head_dim, "index_head_dim", head_dim,
            f"must hold the qk_rope_head_dim ({cfg.qk_rope_head_dim}) rotated dims")
    return dataclasses.replace(
        cfg,
        index_topk=f.get("index_topk", WINDOW, INDEX_TOPK),
        index_n_heads=f.get("index_n_heads", HEADS, INDEX_HEADS[model_type]),
        index_head_dim=head_dim,
        indexer_rope_interleave=interleaved,
    )
