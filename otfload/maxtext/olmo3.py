"""MaxText's OLMo 3 (``decoder_block: olmo3``, ``olmo3-7b``, ``olmo3-7b-pt``, ``olmo3-32b``), as its
converter (``param_mapping.OLMO3_*``) writes it: kernels transposed with heads split, no query
pre-scale (its attention applies ``head_dim ** -0.5``), the norms as stored; MaxText's attention module
is ``attention``, the two norms are OLMo's post-norms (``post_self_attention_layer_norm``,
``post_mlp_layer_norm``: no pre-norms), and the q/k norms span whole projections
(``[heads * head_dim]``, MaxText's "global" q/k norm for OLMo 3). Scanned, MaxText stacks a block of
``inhomogeneous_layer_cycle_interval`` (4: three sliding layers, one global) layers
(``decoder.layers.layers_<j>`` holds HF layers ``j, j + 4, ...``); unscanned trees are
``decoder.layers_<i>``."""

from __future__ import annotations

from otfload.maxtext.tables import (
    ATTN,
    HF_LAYER,
    attention,
    cycle_table,
    dense_mlp,
    norm,
)

LAYERS_PER_BLOCK = 4  # olmo3-7b.yml / 32b.yml; the table is written for four groups

_LEAVES = (
    norm("post_self_attention_layer_norm.scale", f"{HF_LAYER}.post_attention_layernorm.weight"),
    norm("post_mlp_layer_norm.scale", f"{HF_LAYER}.post_feedforward_layernorm.weight"),
    *attention(rope_interleaved=False, query_scaled=False, module="attention"),
    norm("attention.query_norm.scale", f"{ATTN}.q_norm.weight", "mt_num_query_heads * mt_head_dim"),
    norm("attention.key_norm.scale", f"{ATTN}.k_norm.weight", "mt_num_kv_heads * mt_head_dim"),
    *dense_mlp(),
)

OLMO3 = cycle_table("olmo3", "olmo3", _LEAVES, LAYERS_PER_BLOCK)
