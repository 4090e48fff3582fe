"""MaxText's Gemma 2 (``decoder_block: gemma2``, ``gemma2-2b/9b/27b``) and Gemma 3 (``gemma3``,
``gemma3-4b/12b/27b``), as MaxText's converter (``param_mapping.GEMMA2_*`` / ``GEMMA3_*``) writes
them:

* every RMSNorm scale plus one (``x + 1.0``: MaxText's RMSNorm multiplies by its scale, HF's Gemma
  norm by ``1 + weight``), Gemma 3's per-head q/k norms too;
* the embedding multiplied by ``sqrt(hidden)`` (MaxText embeds without the scale HF's forward
  applies; its tied logits divide it out again), ``float32`` for Gemma 2, rounded to ``bfloat16``
  first for Gemma 3 (its converter's ``np.dtype("bfloat16").type(hidden ** 0.5)``), then padded
  with zeros to ``vocab_size``;
* Gemma 2's query kernel pre-scaled by ``float32(1 / sqrt(query_pre_attn_scalar))`` of the
  checkpoint (MaxText's Gemma 2 attention scales nothing itself). MaxText's converter uses
  ``head_dim`` there: the same for gemma-2-2b, but gemma-2-9b and -27b have ``query_pre_attn_scalar``
  224 and 144 beside ``head_dim`` 256 and 128, and MaxText's own loader then attends with another
  temperature than the checkpoint's; otfload follows the checkpoint. Gemma 3's query is not scaled
  (its attention applies ``query_pre_attn_scalar``).

Soft-capping and sliding windows are settings of MaxText's model, not weights. Gemma 2's MaxText
layer is a pair of HF layers, ``*_local`` (sliding, HF layer ``2i``) and ``*_global`` (HF ``2i+1``):
``num_decoder_layers`` counts pairs. Gemma 3 scanned is blocks of six (five sliding, one global):
``decoder.layers.layers_<j>`` stacks HF layers ``j, j + 6, ...`` (``num_decoder_layers // 6`` of
them) and the rest are ``decoder.layers_remainder.layers_<r>``, unstacked; unscanned trees are
``decoder.layers_<i>``. Gemma 3's checkpoints are multimodal (``model_type`` ``gemma3``, the text
model under ``text_config``): the text model's tensors are read under the Hub's
``language_model.model.`` or transformers' ``model.language_model.`` (the names MaxText's converter
reads), the vision tower never.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.families.multimodal import LAYOUTS, either_layout
from otfload.maxtext.tables import (
    ATTN,
    HF_LAYER,
    SCANNED,
    UNSCANNED,
    LayerGroup,
    Leaf,
    ModelTable,
    attention,
    block_groups,
    decoder_layers,
    dense_mlp,
)
from otfload.plan.hooks import Pad, Scale, Shift
from otfload.plan.mapping import MappingTable, Stride

GEMMA3_BLOCK = 6  # gemma3.GEMMA3_ATTENTION_PATTERN: five sliding layers, then a global one
REMAINDER = "decoder.layers_remainder.layers_{layer}"


def gemma_norm(name: str, source: str, size: str = "mt_emb_dim") -> Leaf:
    """A Gemma RMSNorm scale as MaxText reads it: the stored weight plus one."""
    return Leaf(name, source, (Shift(1.0),), (size,), ("tensor",))


def top(embedding_scale: str) -> tuple[Leaf, ...]:
    """The embedding times ``embedding_scale``, zero-padded to ``vocab_size``, and the final norm
    (Gemma's logits come from the embedding: no output kernel)."""
    pad = Pad(0, "mt_vocab_size", original="hf_vocab_size")
    return (Leaf("token_embedder.embedding", "model.embed_tokens.weight", (Scale(embedding_scale), pad),
                 ("mt_vocab_size", "mt_emb_dim"), ("tensor", "fsdp")),
            gemma_norm("decoder.decoder_norm.scale", "model.norm.weight"))


def _norms(suffix: str) -> tuple[Leaf, ...]:
    """The four norms of a Gemma layer (MaxText's names end in ``suffix``)."""
    names = (("pre_self_attention_norm", "input_layernorm"), ("post_self_attention_norm", "post_attention_layernorm"),
             ("pre_ffw_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"))
    return tuple(gemma_norm(f"{mt}{suffix}.scale", f"{HF_LAYER}.{hf}.weight") for mt, hf in names)


def _gemma2_half(kind: str) -> tuple[Leaf, ...]:
    """One half (``local`` or ``global``) of MaxText's Gemma 2 layer."""
    q, *kvo = attention(rope_interleaved=False, query_scaled=False, module=f"self_attention_{kind}")
    q = dataclasses.replace(q, hooks=(*q.hooks, Scale("1 / sqrt(hf_query_pre_attn_scalar)")))
    return (*_norms(f"_{kind}"), q, *kvo, *dense_mlp(module=f"mlp_{kind}"))


GEMMA2 = ModelTable(
    name="gemma2",
    model_types=frozenset({"gemma2"}),
    top=top("sqrt(mt_emb_dim)"),
    groups=tuple(LayerGroup(SCANNED, UNSCANNED, _gemma2_half(kind), indices={"layer": Stride(2, start)})
                 for start, kind in enumerate(("local", "global"))),
    hf_fields=("query_pre_attn_scalar",),
)


@dataclass(frozen=True)
class MultimodalTable(ModelTable):
    """A table of the text model of a multimodal checkpoint: its tensors under either prefix layout
    (:data:`otfload.families.multimodal.LAYOUTS`, the Hub's first, which export writes; Gemma 4's
    Hub layout is transformers' module names)."""

    layouts: tuple[Mapping[str, str], ...] = LAYOUTS

    def mapping(self, scan_layers: bool, config: Mapping[str, Any] | None = None) -> MappingTable:
        return either_layout(super().mapping(scan_layers, config), self.layouts)


_GEMMA3_LAYER = (
    *_norms(""),
    *attention(rope_interleaved=False, query_scaled=False),
    gemma_norm("self_attention.query_norm.scale", f"{ATTN}.q_norm.weight", "mt_head_dim"),
    gemma_norm("self_attention.key_norm.scale", f"{ATTN}.k_norm.weight", "mt_head_dim"),
    *dense_mlp(),
)
_BLOCKS = f"mt_num_decoder_layers // {GEMMA3_BLOCK}"

GEMMA3 = MultimodalTable(
    name="gemma3",
    model_types=frozenset({"gemma3"}),
    top=top("bfloat16(sqrt(mt_emb_dim))"),
    groups=(*block_groups(_GEMMA3_LAYER, GEMMA3_BLOCK, GEMMA3_BLOCK),
            LayerGroup(REMAINDER, REMAINDER, _GEMMA3_LAYER, f"mt_num_decoder_layers % {GEMMA3_BLOCK}",
                       indices={"layer": Stride(1, f"{_BLOCKS} * {GEMMA3_BLOCK}")})),
    unscanned=decoder_layers(*_GEMMA3_LAYER),
)
