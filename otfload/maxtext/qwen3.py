"""MaxText's Qwen3 (``decoder_block: qwen3``) and Qwen3-MoE (``qwen3_moe``): q/k norms per head,
HF's rotate-half RoPE order, no query pre-scale (MaxText's converter only transposes and splits
heads); the MoE block is ``moe_block`` with the router ``gate`` and experts ``wi_0``/``wi_1``/``wo``.
Small Qwen3s tie the output to the embedding (``logits_via_embedding``: no ``logits_dense``)."""

from __future__ import annotations

from otfload.maxtext.tables import (
    HF_LAYER,
    ModelTable,
    attention,
    decoder_layers,
    dense_mlp,
    layer_norms,
    qk_norms,
    routed_experts,
    top_leaves,
)

_ATTENTION = (*layer_norms(), *attention(rope_interleaved=False, query_scaled=False), *qk_norms())

QWEN3 = ModelTable(
    name="qwen3",
    model_types=frozenset({"qwen3"}),
    top=top_leaves(),
    groups=decoder_layers(*_ATTENTION, *dense_mlp()),
)

QWEN3_MOE = ModelTable(
    name="qwen3_moe",
    model_types=frozenset({"qwen3_moe"}),
    top=top_leaves(),
    groups=decoder_layers(*_ATTENTION, *routed_experts("moe_block", f"{HF_LAYER}.mlp.gate.weight",
                                                       f"{HF_LAYER}.mlp.experts",
                                                       ("gate_proj", "up_proj", "down_proj"))),
)
