"""MaxText's Gemma 4 26B (``gemma4-26b``, MoE) and 31B (``gemma4-31b``, dense), ``decoder_block:
gemma4``, as its converter (``param_mapping.GEMMA4_*``) writes them:

* every kernel transposed (``[in, out]``) with its heads split; the global (full-attention) layers'
  q/k with ``global_head_dim`` and ``global_num_kv_heads``, and no value kernel: the table is written
  for ``share_kv_projections`` (the published configs' ``attention_k_eq_v``: the key is the value;
  a tree with a global ``value`` leaf is refused as a leaf no rule maps);
* norms as stored (Gemma 4 checkpoints fold the ``+ 1`` in), ``layer_scalar``, the router's
  ``scale`` (``pre_forward_scale_2``) and ``per_expert_scale`` as stored;
* the MoE experts' fused ``gate_up_proj [E, 2 * moe_mlp, embed]``: its first half ``wi_0``, its
  second ``wi_1``, each ``[E, embed, moe_mlp]``; ``down_proj [E, embed, moe_mlp]`` as ``wo``
  ``[E, moe_mlp, embed]``; the dense MLP (31B's, 26B's shared expert) ``wi_0`` / ``wi_1`` / ``wo``;
* the embedding times ``float32(sqrt(hidden))``, zero-padded to ``vocab_size``; logits via the embedding.

Scanned, a block is six layers, five sliding then one global: ``decoder.scanned_blocks.local_layers``
stacks the sliding ones twice, ``[blocks, 5]`` at ``param_scan_axis`` and the next dimension (HF
layer ``6 * block + position``), ``decoder.scanned_blocks.global_layer`` the global ones (HF ``6 *
block + 5``), and the layers after the last whole block (all sliding) are
``decoder.layers_remainder.local_layers``, stacked once (the tree MaxText's NNX decoder builds; its
converter's ``layers_remainder.layers_<r>`` names are not in that tree; transformers makes a
checkpoint's last layer a full one, so only a multiple of six layers matches MaxText's pattern).

Unscanned, ``decoder.layers_<i>`` is HF layer ``i``, global where ``i % 6 == 5`` (MaxText's
``gemma4.get_attention_type``): there ``self_attention.query.kernel`` is ``[embed, heads, head_dim]`` in
a sliding layer and ``[embed, heads, global_head_dim]`` in a global one at the same path, so the
attention rules of each kind match only its layers (:attr:`otfload.plan.mapping.Rule.only`, from the
groups' ``at``); the other leaves are every layer's. The checkpoints are multimodal
(``model_type`` ``gemma4``): the text model is read under ``model.language_model.`` (where the
Hub's Gemma 4 and transformers keep it; export writes it there) or ``language_model.model.``, the
vision tower never.
"""

from __future__ import annotations

from otfload.families.multimodal import LANGUAGE_MODEL_PREFIXES, MODULE_PREFIXES
from otfload.maxtext.gemma import MultimodalTable, top
from otfload.maxtext.tables import (
    ATTN,
    HF_LAYER,
    O_AXES,
    O_SHAPE,
    Q_SHAPE,
    QKV_AXES,
    UNSCANNED,
    LayerGroup,
    Leaf,
    ModelTable,
    dense_mlp,
    kernel,
    nested_blocks,
    norm,
)
from otfload.plan.hooks import Slice, Transpose
from otfload.plan.mapping import Stride

BLOCK = 6  # gemma4.GEMMA4_ATTENTION_PATTERN: five sliding layers, then a global one
LOCAL = BLOCK - 1
SCANNED_BLOCKS = "decoder.scanned_blocks"
REMAINDER = "decoder.layers_remainder.local_layers"
_BLOCKS = f"mt_num_decoder_layers // {BLOCK}"
_REST = f"mt_num_decoder_layers % {BLOCK}"
_MOE = "mlp.moe_block.MoeBlock_0"
_SWAP = Transpose((0, 2, 1))


def query(head_dim: str) -> tuple[Leaf, ...]:
    """A layer's query and output kernels (heads of ``head_dim``) and its query norm."""
    return (
        kernel("self_attention.query.kernel", f"{ATTN}.q_proj.weight", (*Q_SHAPE[:2], head_dim), QKV_AXES),
        kernel("self_attention.out.kernel", f"{ATTN}.o_proj.weight", (O_SHAPE[0], head_dim, O_SHAPE[2]), O_AXES),
        norm("self_attention.query_norm.scale", f"{ATTN}.q_norm.weight", head_dim),
    )


def key_value(heads: str, head_dim: str, value: bool) -> tuple[Leaf, ...]:
    """A layer's key (and ``value``) kernels with ``heads`` heads of ``head_dim``, and its key norm."""
    kv = ("mt_emb_dim", heads, head_dim)
    names = ("key", "value") if value else ("key",)
    return (*(kernel(f"self_attention.{n}.kernel", f"{ATTN}.{n[0]}_proj.weight", kv, QKV_AXES) for n in names),
            norm("self_attention.key_norm.scale", f"{ATTN}.k_norm.weight", head_dim))


_SLIDING = (*query("mt_head_dim"), *key_value("mt_num_kv_heads", "mt_head_dim", value=True))
_GLOBAL = (*query("mt_global_head_dim"), *key_value("mt_global_num_kv_heads", "mt_global_head_dim", value=False))
NORMS = tuple(norm(f"{mt}.scale", f"{HF_LAYER}.{hf}.weight") for mt, hf in (
    ("pre_self_attention_norm", "input_layernorm"), ("post_self_attention_norm", "post_attention_layernorm"),
    ("pre_ffw_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm")))
SCALAR = Leaf("layer_scalar", f"{HF_LAYER}.layer_scalar", (), ("1",), (None,))
_EXPERT_IN = ("mt_num_experts", "mt_emb_dim", "mt_moe_mlp_dim")
_MOE_MLP = (
    *(norm(f"mlp.{mt}.scale", f"{HF_LAYER}.{mt}.weight") for mt in
      ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")),
    Leaf("mlp.pre_forward_scale_2", f"{HF_LAYER}.router.scale", (), ("mt_emb_dim",), ("fsdp",)),
    kernel(f"{_MOE}.gate.kernel", f"{HF_LAYER}.router.proj.weight", ("mt_emb_dim", "mt_num_experts"), ("fsdp", None)),
    Leaf(f"{_MOE}.wi_0", f"{HF_LAYER}.experts.gate_up_proj", (Slice(1, 0, "mt_moe_mlp_dim"), _SWAP), _EXPERT_IN,
         (None, "fsdp", "tensor")),
    Leaf(f"{_MOE}.wi_1", f"{HF_LAYER}.experts.gate_up_proj", (Slice(1, "mt_moe_mlp_dim"), _SWAP), _EXPERT_IN,
         (None, "fsdp", "tensor")),
    Leaf(f"{_MOE}.wo", f"{HF_LAYER}.experts.down_proj", (_SWAP,), ("mt_num_experts", "mt_moe_mlp_dim", "mt_emb_dim"),
         (None, "tensor", "fsdp")),
    Leaf(f"{_MOE}.per_expert_scale", f"{HF_LAYER}.router.per_expert_scale", (), ("mt_num_experts",), (None,)),
    *dense_mlp("mlp.moe_block.shared_experts"),
)


def _table(name: str, mlp: tuple[Leaf, ...]) -> ModelTable:
    """The table of a Gemma 4 whose every layer has the MLP leaves ``mlp``."""
    shared = (*NORMS, SCALAR, *mlp)
    return MultimodalTable(
        name=name,
        model_types=frozenset({"gemma4"}),
        top=(top("sqrt(mt_emb_dim)")[0], norm("decoder.decoder_norm.scale", "model.norm.weight")),
        groups=(nested_blocks(f"{SCANNED_BLOCKS}.local_layers", (*shared, *_SLIDING), BLOCK, LOCAL),
                LayerGroup(f"{SCANNED_BLOCKS}.global_layer", f"{SCANNED_BLOCKS}.global_layer", (*shared, *_GLOBAL),
                           _BLOCKS, indices={"layer": Stride(BLOCK, LOCAL)}),
                LayerGroup(REMAINDER, REMAINDER, (*shared, *_SLIDING), _REST,
                           indices={"layer": Stride(1, f"{_BLOCKS} * {BLOCK}")})),
        unscanned=(LayerGroup(SCANNED_BLOCKS, UNSCANNED, shared),
                   LayerGroup(SCANNED_BLOCKS, UNSCANNED, _SLIDING, f"mt_num_decoder_layers - {_BLOCKS}",
                              at=tuple(Stride(BLOCK, j) for j in range(LOCAL))),
                   LayerGroup(SCANNED_BLOCKS, UNSCANNED, _GLOBAL, _BLOCKS, at=(Stride(BLOCK, LOCAL),))),
        fields=("global_head_dim", "global_num_kv_heads"),
        layouts=(MODULE_PREFIXES, LANGUAGE_MODEL_PREFIXES),
    )


GEMMA4_MOE = _table("gemma4_moe", _MOE_MLP)
GEMMA4_DENSE = _table("gemma4", dense_mlp())
