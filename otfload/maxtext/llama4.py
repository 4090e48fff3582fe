"""MaxText's Llama 4 (``decoder_block: llama4``: ``llama4-17b-16e`` Scout, ``llama4-17b-128e`` Maverick),
written from its model code (``models/llama4.py``): MaxText 0.2.5 has no converter mapping for it, so
there is no statement of its weights' layout but the NNX model's own tree and how its forward reads it.

* Attention (``self_attention``): q/k/v kernels ``[embed, heads, head_dim]``, ``out`` ``[heads, head_dim,
  embed]``, as stored, transposed and split. Nothing reordered or scaled: MaxText's Llama 4 RoPE
  (``LLaMARotaryEmbedding``) rotates adjacent pairs, the pairs HF's Llama 4 rotates (its complex RoPE
  on ``reshape(..., -1, 2)``), and the attention itself multiplies the query by ``head_dim ** -0.5``
  (``query_pre_attn_scalar``; the L2 norm of ``use_qk_norm`` follows RoPE, no weight). NoPE layers,
  chunked attention and temperature tuning are settings, not weights.
* Norms ``pre_self_attention_layer_norm`` / ``post_self_attention_layer_norm`` as stored.
* A dense layer's ``mlp`` (``wi_0`` gate, ``wi_1`` up, ``wo``; ``mlp_dim`` wide); a MoE layer's
  ``Llama4MoEBlock_0``: ``MoeBlock_0.gate.kernel`` the router transposed, the experts from HF's fused
  ``experts.gate_up_proj`` ``[E, embed, 2 * moe_mlp]`` (already ``[in, out]``: its first half of the last
  axis ``wi_0``, the second ``wi_1``) and ``experts.down_proj`` ``[E, moe_mlp, embed]`` as ``wo``, as
  stored; ``shared_experts`` a dense MLP ``moe_mlp_dim`` wide.

Layer ``i`` is MoE where ``(i + 1) % interleave_moe_layer_step == 0`` (16E: every layer; 128E: every
second), as MaxText's ``determine_is_moe_layer`` and HF's ``moe_layers`` say; a table is written for
each published step (the config's ``interleave_moe_layer_step`` must be it). Scanned, MaxText's
``Llama4ScannableBlock`` of ``inhomogeneous_layer_cycle_interval`` (4) layers: ``decoder.layers.layers_<j>``
stacks HF layers ``j, j + 4, ...`` at ``param_scan_axis``; unscanned, ``decoder.layers_<i>`` has its
kind's feed-forward leaves. The checkpoints are multimodal (``model_type`` ``llama4``): the text model is
read under ``language_model.model.`` (the Hub's) or ``model.language_model.``, the vision tower never.
"""

from __future__ import annotations

from otfload.maxtext.gemma import MultimodalTable
from otfload.maxtext.tables import (
    CYCLE,
    HF_LAYER,
    SCANNED,
    UNSCANNED,
    LayerGroup,
    Leaf,
    attention,
    dense_mlp,
    kernel,
    layer_norms,
    top_leaves,
)
from otfload.plan.hooks import Slice
from otfload.plan.mapping import Stride

PERIOD = 4  # llama4-17b-*.yml's inhomogeneous_layer_cycle_interval (the NoPE interval's)
_FFN = f"{HF_LAYER}.feed_forward"
_MOE = "Llama4MoEBlock_0"
_EXPERT_IN = ("mt_num_experts", "mt_emb_dim", "mt_moe_mlp_dim")

_SHARED = (*layer_norms(), *attention(rope_interleaved=False, query_scaled=False))
_DENSE = dense_mlp("mlp", _FFN)
_MOE_MLP = (
    kernel(f"{_MOE}.MoeBlock_0.gate.kernel", f"{_FFN}.router.weight", ("mt_emb_dim", "mt_num_experts"), ("fsdp", None)),
    Leaf(f"{_MOE}.MoeBlock_0.wi_0", f"{_FFN}.experts.gate_up_proj", (Slice(2, 0, "mt_moe_mlp_dim"),), _EXPERT_IN,
         (None, "fsdp", "tensor")),
    Leaf(f"{_MOE}.MoeBlock_0.wi_1", f"{_FFN}.experts.gate_up_proj", (Slice(2, "mt_moe_mlp_dim"),), _EXPERT_IN,
         (None, "fsdp", "tensor")),
    Leaf(f"{_MOE}.MoeBlock_0.wo", f"{_FFN}.experts.down_proj", (), ("mt_num_experts", "mt_moe_mlp_dim", "mt_emb_dim"),
         (None, "tensor", "fsdp")),
    *dense_mlp(f"{_MOE}.shared_experts", f"{_FFN}.shared_expert", "mt_moe_mlp_dim"),
)


def _is_moe(layer: int, step: int) -> bool:
    return (layer + 1) % step == 0


def _table(name: str, step: int) -> MultimodalTable:
    """Llama 4 whose every ``step``-th layer is MoE (the others dense)."""
    blocks = f"mt_num_decoder_layers // {PERIOD}"
    scanned = tuple(LayerGroup(f"{SCANNED}.layers_{j}", f"{SCANNED}.layers_{j}",
                               (*_SHARED, *(_MOE_MLP if _is_moe(j, step) else _DENSE)), blocks,
                               indices={"layer": Stride(PERIOD, j)}) for j in range(PERIOD))
    moe_layers = f"mt_num_decoder_layers // {step}"
    unscanned = [LayerGroup(SCANNED, UNSCANNED, _SHARED),
                 LayerGroup(SCANNED, UNSCANNED, _MOE_MLP, moe_layers, at=(Stride(step, step - 1),))]
    if step > 1:
        unscanned.append(LayerGroup(SCANNED, UNSCANNED, _DENSE, f"mt_num_decoder_layers - {moe_layers}",
                                    at=tuple(Stride(step, j) for j in range(step - 1))))
    return MultimodalTable(name=name, model_types=frozenset({"llama4"}), top=top_leaves(), groups=scanned,
                           unscanned=tuple(unscanned), fixed={CYCLE.removeprefix("mt_"): PERIOD,
                                                       "interleave_moe_layer_step": step})


LLAMA4_SCOUT = _table("llama4", 1)
LLAMA4_MAVERICK = _table("llama4_interleaved", 2)
