"""MaxText's DeepSeek (``decoder_block: deepseek``): DeepSeek-V3 (``deepseek3-671b``), V3.2
(``deepseek3.2-671b``) and V2-Lite (``deepseek2-16b``). MLA attention, kernels ``[in, out]`` with
heads split and nothing else changed (MaxText's converter only transposes and reshapes: its MLA
applies the interleaved RoPE HF's checkpoints are stored for, and its own softmax scale). The first
``first_num_dense_layers`` layers are ``decoder.dense_layers`` (a dense MLP), the rest
``decoder.moe_layers`` (unscanned ``moe_layers_<i>`` reading HF layer ``first_num_dense_layers +
i``): the routed experts of ``DeepSeekMoeBlock_0.MoeBlock_0`` and ``shared_experts``
(``shared_experts * moe_mlp_dim`` wide).

V3 has a q LoRA (``wq_a``, ``q_norm``, ``wq_b``) and the router's ``e_score_correction_bias`` as
``MoeBlock_0.gate.bias``, a ``MoEBiasVar`` (not an ``nnx.Param``), which MaxText scans with the
layer axis first whatever ``param_scan_axis`` says; V2-Lite (``q_lora_rank: 0``) has ``query`` and
no bias. V3.2 is V3 with DeepSeek Sparse Attention's lightning indexer in every layer's attention
(``self_attention.indexer``, ``use_indexer``): ``wq_b`` (from the query latent, heads split), ``wk``
and ``weights_proj`` as ``[in, out]`` kernels, the key's LayerNorm ``k_norm`` scale and bias as stored
(MaxText's indexer, as HF's, rotates the first ``qk_rope_head_dim`` dims rotate-half: no reordering).

V3's multi-token-prediction layer (HF layer ``num_hidden_layers``: ``enorm``, ``hnorm``, ``eh_proj``,
``shared_head.norm`` and a MoE layer) is MaxText's ``mtp_block.mtp_layer_1`` when ``mtp_num_layers``
is 1 (MaxText's converter maps none of it): ``mtp_1_embedding_norm`` / ``mtp_1_hidden_state_norm``
the two norms, ``mtp_1_projection`` ``eh_proj`` as ``[in, out]`` (MaxText concatenates ``[embedding,
hidden]`` as DeepSeek does), ``mtp_1_final_norm`` the shared head's norm (the head itself is the
model's own output kernel, as in MaxText), ``mtp_1_transformer_layer`` the MoE layer's leaves.
"""

from __future__ import annotations

import dataclasses

from otfload.maxtext.tables import (
    ATTN,
    HF_LAYER,
    ExtraLayer,
    LayerGroup,
    Leaf,
    ModelTable,
    dense_mlp,
    kernel,
    layer_norms,
    norm,
    routed_experts,
    top_leaves,
)

_HEADS = "mt_num_query_heads"
_QK_HEAD = "mt_qk_nope_head_dim + mt_qk_rope_head_dim"
_MOE = "DeepSeekMoeBlock_0"
_DENSE = "mt_first_num_dense_layers"
MLA_FIELDS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_num_dense_layers",
              "shared_experts")
INDEXER_FIELDS = ("indexer_n_heads", "indexer_head_dim")


def _query(q_lora: bool) -> tuple[Leaf, ...]:
    """V3's q LoRA (down, norm, up) or V2-Lite's one query kernel, per head ``[nope | rope]``."""
    a = "self_attention"
    if not q_lora:
        return (kernel(f"{a}.query.kernel", f"{ATTN}.q_proj.weight", ("mt_emb_dim", _HEADS, _QK_HEAD),
                       ("fsdp", "tensor", None)),)
    return (kernel(f"{a}.wq_a.kernel", f"{ATTN}.q_a_proj.weight", ("mt_emb_dim", "mt_q_lora_rank"), ("fsdp", None)),
            norm(f"{a}.q_norm.scale", f"{ATTN}.q_a_layernorm.weight", "mt_q_lora_rank"),
            kernel(f"{a}.wq_b.kernel", f"{ATTN}.q_b_proj.weight", ("mt_q_lora_rank", _HEADS, _QK_HEAD),
                   ("fsdp", "tensor", None)))


def _indexer() -> tuple[Leaf, ...]:
    """V3.2's lightning indexer (``indexer_n_heads`` heads of ``indexer_head_dim``, one shared key)."""
    a, hf, heads, dim = "self_attention.indexer", f"{ATTN}.indexer", "mt_indexer_n_heads", "mt_indexer_head_dim"
    return (kernel(f"{a}.wq_b.kernel", f"{hf}.wq_b.weight", ("mt_q_lora_rank", heads, dim), ("fsdp", "tensor", None)),
            kernel(f"{a}.wk.kernel", f"{hf}.wk.weight", ("mt_emb_dim", dim), ("fsdp", None)),
            Leaf(f"{a}.k_norm.scale", f"{hf}.k_norm.weight", (), (dim,), (None,)),
            Leaf(f"{a}.k_norm.bias", f"{hf}.k_norm.bias", (), (dim,), (None,)),
            kernel(f"{a}.weights_proj.kernel", f"{hf}.weights_proj.weight", ("mt_emb_dim", heads), ("fsdp", "tensor")))


def _mla(q_lora: bool, indexer: bool = False) -> tuple[Leaf, ...]:
    """A layer's norms and MLA: the kv LoRA (``wkv_a`` also carries the shared RoPE key), the output
    and V3.2's indexer."""
    a = "self_attention"
    return (*layer_norms(), *_query(q_lora), *(_indexer() if indexer else ()),
            kernel(f"{a}.wkv_a.kernel", f"{ATTN}.kv_a_proj_with_mqa.weight",
                   ("mt_emb_dim", "mt_kv_lora_rank + mt_qk_rope_head_dim"), ("fsdp", None)),
            norm(f"{a}.kv_norm.scale", f"{ATTN}.kv_a_layernorm.weight", "mt_kv_lora_rank"),
            kernel(f"{a}.wkv_b.kernel", f"{ATTN}.kv_b_proj.weight",
                   ("mt_kv_lora_rank", _HEADS, "mt_qk_nope_head_dim + mt_v_head_dim"), ("fsdp", "tensor", None)),
            kernel(f"{a}.out.kernel", f"{ATTN}.o_proj.weight", (_HEADS, "mt_v_head_dim", "mt_emb_dim"),
                   ("tensor", None, "fsdp")))


def _mtp(moe: tuple[Leaf, ...]) -> ExtraLayer:
    """V3's multi-token-prediction layer (HF layer ``num_hidden_layers``) as MaxText's ``mtp_layer_1``."""
    mt, hf = "mtp_block.mtp_layer_{mtp}.mtp_1", "model.layers.{mtp}"
    layer = tuple(dataclasses.replace(leaf, path=f"{mt}_transformer_layer.{leaf.path}",
                                      source=leaf.source.replace(HF_LAYER, hf)) for leaf in moe)
    return ExtraLayer("mtp_num_layers", (
        norm(f"{mt}_embedding_norm.scale", f"{hf}.enorm.weight"),
        norm(f"{mt}_hidden_state_norm.scale", f"{hf}.hnorm.weight"),
        kernel(f"{mt}_projection.kernel", f"{hf}.eh_proj.weight", ("2 * mt_emb_dim", "mt_emb_dim"), ("fsdp", None)),
        norm(f"{mt}_final_norm.scale", f"{hf}.shared_head.norm.weight"),
        *layer), "mt_num_decoder_layers")


def _table(name: str, model_type: str, v3: bool, indexer: bool = False) -> ModelTable:
    mlp, attention = f"{HF_LAYER}.mlp", _mla(v3, indexer)
    bias = (Leaf(f"{_MOE}.MoeBlock_0.gate.bias", f"{mlp}.gate.e_score_correction_bias", (), ("mt_num_experts",),
                 (None,), layer_at=0),) if v3 else ()
    moe = (*attention, *routed_experts(f"{_MOE}.MoeBlock_0", f"{mlp}.gate.weight", f"{mlp}.experts",
                                      ("gate_proj", "up_proj", "down_proj")), *bias,
           *dense_mlp(f"{_MOE}.shared_experts", f"{mlp}.shared_experts", "mt_shared_experts * mt_moe_mlp_dim"))
    groups = (LayerGroup("decoder.dense_layers", "decoder.dense_layers_{layer}", (*attention, *dense_mlp()), _DENSE),
              LayerGroup("decoder.moe_layers", "decoder.moe_layers_{layer}", moe, f"mt_num_decoder_layers - {_DENSE}",
                         offsets={"layer": _DENSE}))
    fields = (*MLA_FIELDS, "q_lora_rank", *(INDEXER_FIELDS if indexer else ())) if v3 else MLA_FIELDS
    return ModelTable(name=name, model_types=frozenset({model_type}), top=top_leaves(), groups=groups,
                      fields=fields, extras=(_mtp(moe),) if v3 else ())


DEEPSEEK3 = _table("deepseek3", "deepseek_v3", v3=True)
DEEPSEEK32 = _table("deepseek3.2", "deepseek_v32", v3=True, indexer=True)
DEEPSEEK2 = _table("deepseek2", "deepseek_v2", v3=False)
