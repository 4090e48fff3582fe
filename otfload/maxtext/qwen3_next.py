"""MaxText's Qwen3-Next (``decoder_block: qwen3_next``, ``qwen3-next-80b-a3b``), as its converter
(``param_mapping.QWEN3_NEXT_*``) writes it: every kernel transposed (``[in, out]``), the full
attention's q/k/v split into heads (the query ``[embed, heads, 2 * head_dim]``: each head's query
and its output gate, as HF's ``q_proj`` holds them), its output kernel ``[heads * head_dim, embed]``
unsplit; the Gated DeltaNet's ``in_proj_qkvz`` / ``in_proj_ba`` / ``out_proj`` transposed as stored,
its ``conv1d`` ``[kernel, 1, channels]`` (HF's ``[channels, 1, kernel]`` reversed); norms (HF's
``1 + weight`` ones too: MaxText's Qwen3-Next RMSNorm adds the one), ``A_log`` and ``dt_bias`` as stored.
Every layer is MoE: ``mlp.routed_experts`` (router ``gate``, experts ``wi_0`` / ``wi_1`` / ``wo``),
``mlp.shared_expert`` and its ``shared_expert_gate``.

Scanned, a block is ``inhomogeneous_layer_cycle_interval`` (4) layers, three linear then one full:
``decoder.layers.local_layers`` stacks the linear ones twice, ``[blocks, 3]`` at ``param_scan_axis``
and the next dimension (HF layer ``4 * block + position``), ``decoder.layers.global_layer`` the full
ones (HF ``4 * block + 3``). Unscanned, ``decoder.layers_<i>`` has the linear attention's leaves or
the full attention's by kind, and the norms and MoE in every layer.
"""

from __future__ import annotations

from otfload.maxtext.tables import (
    ATTN,
    CYCLE,
    HF_LAYER,
    KV_SHAPE,
    QKV_AXES,
    SCANNED,
    UNSCANNED,
    LayerGroup,
    Leaf,
    ModelTable,
    T,
    dense_mlp,
    kernel,
    nested_blocks,
    routed_experts,
    top_leaves,
)
from otfload.plan.hooks import Transpose
from otfload.plan.mapping import Stride

PERIOD = 4  # qwen3-next-80b-a3b.yml's inhomogeneous_layer_cycle_interval; the table is written for it
LINEAR = f"{HF_LAYER}.linear_attn"
_KEY_DIM = "mt_gdn_num_key_heads * mt_gdn_key_head_dim"
_VALUE_DIM = "mt_gdn_num_value_heads * mt_gdn_value_head_dim"


def _vector(name: str, source: str, size: str) -> Leaf:
    """A 1-D weight as stored, replicated (as MaxText shards Qwen3-Next's norms and GDN vectors)."""
    return Leaf(name, source, (), (size,), (None,))


_SHARED = (
    _vector("input_layernorm.scale", f"{HF_LAYER}.input_layernorm.weight", "mt_emb_dim"),
    _vector("post_attention_layernorm.scale", f"{HF_LAYER}.post_attention_layernorm.weight", "mt_emb_dim"),
    *routed_experts("mlp.routed_experts", f"{HF_LAYER}.mlp.gate.weight", f"{HF_LAYER}.mlp.experts",
                    ("gate_proj", "up_proj", "down_proj")),
    *dense_mlp("mlp.shared_expert", f"{HF_LAYER}.mlp.shared_expert", "mt_moe_mlp_dim"),
    kernel("mlp.shared_expert_gate.kernel", f"{HF_LAYER}.mlp.shared_expert_gate.weight", ("mt_emb_dim", "1"),
           ("fsdp", None)),
)
_LINEAR = (
    kernel("attention.in_proj_qkvz.kernel", f"{LINEAR}.in_proj_qkvz.weight",
           ("mt_emb_dim", f"2 * {_KEY_DIM} + 2 * {_VALUE_DIM}"), ("fsdp", None)),
    kernel("attention.in_proj_ba.kernel", f"{LINEAR}.in_proj_ba.weight", ("mt_emb_dim", "2 * mt_gdn_num_value_heads"),
           ("fsdp", None)),
    Leaf("attention.conv1d.kernel", f"{LINEAR}.conv1d.weight", (Transpose((2, 1, 0)),),
         ("mt_gdn_conv_kernel_dim", "1", f"2 * {_KEY_DIM} + {_VALUE_DIM}"), (None, None, None)),
    _vector("attention.A_log", f"{LINEAR}.A_log", "mt_gdn_num_value_heads"),
    _vector("attention.dt_bias", f"{LINEAR}.dt_bias", "mt_gdn_num_value_heads"),
    _vector("attention.norm.rms_norm.scale", f"{LINEAR}.norm.weight", "mt_gdn_value_head_dim"),
    kernel("attention.out_proj.kernel", f"{LINEAR}.out_proj.weight", (_VALUE_DIM, "mt_emb_dim"), (None, "fsdp")),
)
_FULL = (
    kernel("attention.attention.query.kernel", f"{ATTN}.q_proj.weight",
           ("mt_emb_dim", "mt_num_query_heads", "2 * mt_head_dim"), QKV_AXES),
    kernel("attention.attention.key.kernel", f"{ATTN}.k_proj.weight", KV_SHAPE, QKV_AXES),
    kernel("attention.attention.value.kernel", f"{ATTN}.v_proj.weight", KV_SHAPE, QKV_AXES),
    Leaf("attention.attention.out.kernel", f"{ATTN}.o_proj.weight", (T,),
         ("mt_num_query_heads * mt_head_dim", "mt_emb_dim"), (None, "fsdp")),
    _vector("attention.attention.query_norm.scale", f"{ATTN}.q_norm.weight", "mt_head_dim"),
    _vector("attention.attention.key_norm.scale", f"{ATTN}.k_norm.weight", "mt_head_dim"),
)
_BLOCKS = f"mt_num_decoder_layers // {PERIOD}"

QWEN3_NEXT = ModelTable(
    name="qwen3_next",
    model_types=frozenset({"qwen3_next"}),
    top=top_leaves(),
    groups=(nested_blocks(f"{SCANNED}.local_layers", (*_SHARED, *_LINEAR), PERIOD, PERIOD - 1),
            LayerGroup(f"{SCANNED}.global_layer", f"{SCANNED}.global_layer", (*_SHARED, *_FULL), _BLOCKS,
                       indices={"layer": Stride(PERIOD, PERIOD - 1)})),
    unscanned=(LayerGroup(SCANNED, UNSCANNED, _SHARED),
               LayerGroup(SCANNED, UNSCANNED, _LINEAR, f"{_BLOCKS} * {PERIOD - 1}",
                          at=tuple(Stride(PERIOD, j) for j in range(PERIOD - 1))),
               LayerGroup(SCANNED, UNSCANNED, _FULL, _BLOCKS, at=(Stride(PERIOD, PERIOD - 1),))),
    fields=("gdn_num_key_heads", "gdn_key_head_dim", "gdn_num_value_heads", "gdn_value_head_dim",
            "gdn_conv_kernel_dim"),
    fixed={CYCLE.removeprefix("mt_"): PERIOD},
)
