"""What the MLA families share (DeepSeek-V2/V3 and Kimi-K2 in :mod:`otfload.families.deepseek`,
DeepSeek-V3.2 and GLM-5 in :mod:`otfload.families.deepseek_v32`): the parsed config
(:class:`MlaConfig`), the mapping table and the tensor checks of the
:class:`~otfload.models.mla_decoder.MlaForCausalLM` decoder.

Mapping: HF layers ``0 .. first_k_dense_replace - 1`` feed ``dense_layers`` and the rest
``moe_layers``, whose rules carry ``offsets={"layer": "first_k_dense_replace"}`` so the group's
index ``i`` reads HF layer ``first_k_dense_replace + i``. Every leaf keeps HF's ``[out, in]``
orientation, so no hook transposes. Fused MLA projections are split on their (leading) output dim,
so each leaf reads only its contiguous rows: ``kv_a_proj_with_mqa`` → ``kv_a`` (latent) +
``k_rope``; ``kv_b_proj`` (per head ``[k_nope | v]``) → ``k_b`` + ``v_b``. Routed experts are
per-expert HF keys stacked on the ``experts`` axis by the ``{expert}`` placeholder. The DSA
indexer's tensors (``self_attn.indexer.*``) map to ``attn.indexer``: ``wq_b`` → ``q`` (viewed per
head), ``wk`` → ``k``, ``k_norm`` → ``k_norm`` (scale and bias), ``weights_proj`` →
``head_weights``. The MTP layer of V3-style checkpoints (HF index ``num_hidden_layers``) matches no
rule: it is listed as unused and never read.

``lm_head.weight`` has no fallback: tied configs build no ``lm_head`` leaf, and an untied one whose
checkpoint lacks it is a missing tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

from otfload.config import (
    BOOL,
    EPS,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    NAME,
    POSITIVE,
    VOCAB,
    Choice,
    Count,
    Dim,
    Fields,
    Int,
    Str,
    padding_idx,
    require,
    rope_params,
)
from otfload.config.fields import MAX_EXPERTS, MAX_LAYERS
from otfload.errors import ConfigError
from otfload.families.decoder_rules import decoder_table, mlp_rules, norm_rules, routed_rules
from otfload.plan.hooks import Reshape, Slice
from otfload.plan.mapping import Rule

V2 = "deepseek_v2"
V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
ACTIVATIONS = Choice("silu", "swish")
# transformers reads ``n_routed_experts``; the other names are accepted as before.
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")
# Shared experts and dense layers may be none.
COUNT = Int(0, MAX_EXPERTS)
DENSE_LAYERS = Int(0, MAX_LAYERS)
# transformers' V3 config defaults to one multi-token-prediction layer, stored after the last layer
# (``model.layers.{num_hidden_layers}``) and never loaded; V2 has none.
V3_MTP_LAYERS = 1
# Only every layer after the dense ones being MoE is implemented (the published models' layout).
MOE_LAYER_FREQ = Int(1, 1)


@dataclass(frozen=True)
class MlaConfig:
    """The fields of an MLA model's ``config.json`` the model uses, under the config's names
    (``to_dict()`` feeds the mapping's hooks and offsets), except ``num_experts``: the routed experts
    (``n_routed_experts`` or an alias, :data:`EXPERT_FIELDS`), named as in the other MoE configs.
    ``topk_method`` matters for V2 only: V3 and later always route by groups. ``index_topk`` is
    None without a DSA indexer (V2, V3); the indexer fields are set by the DSA families' parser."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rope_interleave: bool
    tie_word_embeddings: bool
    mtp_layers: int = 0  # multi-token-prediction layers stored after the last layer (never loaded)
    pad_token_id: int | None = None
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @property
    def sigmoid_routing(self) -> bool:
        """V3 and later: sigmoid scores with a correction bias; V2: softmax."""
        return self.model_type != V2

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> MlaConfig:
        """Parse and check ``config.json`` (absent fields take transformers' defaults); every
        ``model_type`` but ``deepseek_v2`` is read as DeepSeek-V3 reads it."""
        f = Fields(hf)
        model_type = f.get("model_type", NAME)
        v3 = model_type != V2
        for flag in ("attention_bias", "mlp_bias"):
            if f.get(flag, BOOL, False):
                raise ConfigError(flag, True, f"{model_type} with {flag}=true is not supported")
        f.get("hidden_act", ACTIVATIONS, "silu")
        f.get("moe_layer_freq", MOE_LAYER_FREQ, 1)
        methods = Str() if v3 else Choice(*V2_TOPK_METHODS)  # V3 always routes by groups (as transformers)
        topk_method = f.get("topk_method", methods, "noaux_tc" if v3 else "greedy")
        theta, scaling = rope_params(f)
        num_hidden_layers = f.get("num_hidden_layers", LAYERS)
        experts_field, experts = f.first(EXPERT_FIELDS, EXPERTS)
        top_k = f.get("num_experts_per_tok", EXPERTS)
        require(top_k <= experts, "num_experts_per_tok", top_k, f"must be at most {experts_field} ({experts})")
        n_group = f.get("n_group", EXPERTS, 1)
        require(experts % n_group == 0, "n_group", n_group,
                f"must divide {experts_field} ({experts}) into equal groups")
        if v3:  # V3 scores each group by the sum of its top 2 experts
            require(experts // n_group >= 2, "n_group", n_group,
                    f"must leave at least 2 experts per group ({experts_field} = {experts})")
        topk_group = f.get("topk_group", EXPERTS, 1)
        require(topk_group <= n_group, "topk_group", topk_group, f"must be at most n_group ({n_group})")
        rope_dim = f.get("qk_rope_head_dim", HEAD_DIM)
        require(rope_dim % 2 == 0, "qk_rope_head_dim", rope_dim, "must be even: RoPE rotates pairs of dimensions")
        return cls(
            model_type=model_type,
            vocab_size=f.get("vocab_size", VOCAB),
            hidden_size=f.get("hidden_size", HIDDEN),
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE),
            num_hidden_layers=num_hidden_layers,
            first_k_dense_replace=min(f.get("first_k_dense_replace", DENSE_LAYERS, 0), num_hidden_layers),
            num_attention_heads=f.get("num_attention_heads", HEADS),
            q_lora_rank=f.get("q_lora_rank", HEAD_DIM, None),
            kv_lora_rank=f.get("kv_lora_rank", HEAD_DIM),
            qk_nope_head_dim=f.get("qk_nope_head_dim", HEAD_DIM),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.get("v_head_dim", HEAD_DIM),
            num_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=f.get("n_shared_experts", COUNT, 0),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            norm_topk_prob=f.get("norm_topk_prob", BOOL, False),
            routed_scaling_factor=f.get("routed_scaling_factor", POSITIVE, 1.0),
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            # V2 always rotates interleaved pairs (complex multiplication); V3 makes it a flag.
            rope_interleave=f.get("rope_interleave", BOOL, True) if v3 else True,
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
            mtp_layers=f.get("num_nextn_predict_layers", DENSE_LAYERS, V3_MTP_LAYERS) if v3 else 0,
            pad_token_id=padding_idx(f, f.get("vocab_size", VOCAB)),
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value (and ``qk_head_dim``), for the mapping table's hooks."""
        return {**dataclasses.asdict(self), "qk_head_dim": self.qk_head_dim}


# --- the mapping table ----------------------------------------------------------------------------

HF = "model.layers.{layer}"
ATTN = f"{HF}.self_attn"
# kv_b_proj.weight [heads * (nope + v), kv_lora] viewed as [heads, nope + v, kv_lora].
KV_B_HEADS = Reshape(("num_attention_heads", -1, "kv_lora_rank"))


def layer_rules(group: str, *, moe: bool) -> list[Rule]:
    """Rules for one layer group (``dense_layers`` or ``moe_layers``)."""
    rule = partial(Rule, offsets={"layer": "first_k_dense_replace"}) if moe else Rule
    g = f"{group}.{{layer}}"
    a, i = f"{g}.attn", f"{ATTN}.indexer"
    rules = [
        *norm_rules(g, HF, rule),
        rule(f"{a}.q.kernel", f"{ATTN}.q_proj.weight", (Reshape(("num_attention_heads", -1, "hidden_size")),)),
        rule(f"{a}.q_a.kernel", f"{ATTN}.q_a_proj.weight"),
        rule(f"{a}.q_a_norm.scale", f"{ATTN}.q_a_layernorm.weight"),
        rule(f"{a}.q_b.kernel", f"{ATTN}.q_b_proj.weight", (Reshape(("num_attention_heads", -1, "q_lora_rank")),)),
        rule(f"{a}.kv_a.kernel", f"{ATTN}.kv_a_proj_with_mqa.weight", (Slice(0, 0, "kv_lora_rank"),)),
        rule(f"{a}.k_rope.kernel", f"{ATTN}.kv_a_proj_with_mqa.weight", (Slice(0, "kv_lora_rank"),)),
        rule(f"{a}.kv_a_norm.scale", f"{ATTN}.kv_a_layernorm.weight"),
        rule(f"{a}.k_b.kernel", f"{ATTN}.kv_b_proj.weight", (KV_B_HEADS, Slice(1, 0, "qk_nope_head_dim"))),
        rule(f"{a}.v_b.kernel", f"{ATTN}.kv_b_proj.weight", (KV_B_HEADS, Slice(1, "qk_nope_head_dim"))),
        rule(f"{a}.o.kernel", f"{ATTN}.o_proj.weight",
             (Reshape(("hidden_size", "num_attention_heads", "v_head_dim")),)),
        rule(f"{a}.indexer.q.kernel", f"{i}.wq_b.weight", (Reshape(("index_n_heads", -1, "q_lora_rank")),)),
        rule(f"{a}.indexer.k.kernel", f"{i}.wk.weight"),
        rule(f"{a}.indexer.k_norm.scale", f"{i}.k_norm.weight"),
        rule(f"{a}.indexer.k_norm.bias", f"{i}.k_norm.bias"),
        rule(f"{a}.indexer.head_weights.kernel", f"{i}.weights_proj.weight"),
    ]
    return rules + (routed_rules(f"{g}.moe", f"{HF}.mlp", rule) if moe else mlp_rules(f"{g}.mlp", f"{HF}.mlp", rule))


MLA_TABLE = decoder_table(*layer_rules("dense_layers", moe=False), *layer_rules("moe_layers", moe=True))


def mla_checks(cfg: MlaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer (plus MTP) and expert counts, vocabulary, width, heads, router rows and (with an
    indexer) the indexer's heads against the tensors."""
    experts = next((k for k in EXPERT_FIELDS if config.get(k) is not None), EXPERT_FIELDS[0])
    # Without MoE layers (every layer dense) no expert tensor is read, so none is counted.
    moe = (Count(experts, cfg.num_experts, "expert"),) if cfg.num_moe_layers else ()
    indexer = () if cfg.index_topk is None else (
        Dim("index_n_heads", cfg.index_n_heads, f"{ATTN}.indexer.weights_proj.weight", 0),
        Dim("index_head_dim", cfg.index_head_dim, f"{ATTN}.indexer.wk.weight", 0),
    )
    return (
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer", extra=cfg.mtp_layers),
        *moe,
        Dim("vocab_size", cfg.vocab_size, "model.embed_tokens.weight", 0),
        Dim("hidden_size", cfg.hidden_size, "model.embed_tokens.weight", 1),
        Dim("num_attention_heads", cfg.num_attention_heads, f"{ATTN}.o_proj.weight", 1, ("v_head_dim", cfg.v_head_dim)),
        Dim(experts, cfg.num_experts, f"{HF}.mlp.gate.weight", 0),
        *indexer,
    )
