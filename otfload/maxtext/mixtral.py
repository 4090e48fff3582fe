"""MaxText's Mixtral (``decoder_block: mixtral``, ``mixtral-8x7b/8x22b``): HF's rotate-half RoPE
order, the query kernel pre-scaled by ``float32(1/sqrt(head_dim))`` (its converter's one value
hook), the MoE block ``MoeBlock_0`` (router ``gate``, experts ``wi_0`` = w1, ``wi_1`` = w3,
``wo`` = w2)."""

from __future__ import annotations

from otfload.maxtext.tables import (
    HF_LAYER,
    ModelTable,
    attention,
    decoder_layers,
    layer_norms,
    routed_experts,
    top_leaves,
)

_MOE = f"{HF_LAYER}.block_sparse_moe"

MIXTRAL = ModelTable(
    name="mixtral",
    model_types=frozenset({"mixtral"}),
    top=top_leaves(),
    groups=decoder_layers(*layer_norms(), *attention(rope_interleaved=False, query_scaled=True),
                          *routed_experts("MoeBlock_0", f"{_MOE}.gate.weight", f"{_MOE}.experts", ("w1", "w3", "w2"))),
)
