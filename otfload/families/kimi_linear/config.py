"""Kimi-Linear's config (``kimi_linear``): ``config.json`` parsed and checked into a
:class:`KimiLinearConfig`, as transformers 5.24's ``KimiLinearConfig`` reads it.

Layers are Kimi Delta Attention (``linear_attention``) or MLA (``full_attention``) by ``layer_types``,
else by the release's ``linear_attn_config.kda_layers`` / ``full_attn_layers`` (1-based), else every
4th layer but the first is MLA; their feed-forward is a dense SwiGLU (``dense``) or DeepSeek's MoE
(``sparse``) by ``mlp_layer_types``, else the first ``first_k_dense_replace`` (1) layers dense. Each
(mixer, feed-forward) pair is a group of its own (:data:`GROUPS`), listing its HF layers in the field
of its name. ``linear_attn_config``'s ``head_dim``, ``num_heads`` and ``short_conv_kernel_size``
override ``linear_head_dim``, ``linear_num_heads`` and ``linear_conv_kernel_dim``. The MoE fields are
read under the names the releases and transformers' ``save_pretrained`` write (``num_experts``,
``num_experts_per_token``, ``num_expert_group``, ``num_shared_experts``, ``moe_renormalize``) or
their aliases (``num_local_experts``, ``num_experts_per_tok``, ``n_group``, ``n_shared_experts``,
``norm_topk_prob``).

The MLA layers apply no rotary embedding (transformers' Kimi-Linear attention rotates nothing; the
releases say ``mla_use_nope: true``). Refused by name: another activation than SiLU, attention
biases, ``mla_use_nope: false``, a router activation other than sigmoid, fewer key/value heads than
heads, an unknown layer or MLP type, and layer lists that leave a layer out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
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
    Fields,
    Int,
    List,
    padding_idx,
    require,
)
from otfload.config.fields import MAX_EXPERTS, MAX_LAYERS
from otfload.config.layer_types import FULL
from otfload.errors import ConfigError

LINEAR = "linear_attention"
LAYER_TYPES = List(Choice(LINEAR, FULL))
DENSE, SPARSE = "dense", "sparse"
MLP_TYPES = List(Choice(DENSE, SPARSE))
ACTIVATIONS = Choice("silu", "swish")
ROUTER_ACTIVATIONS = Choice("sigmoid")
CONV_TAPS = Int(1, 64)
COUNT = Int(0, MAX_EXPERTS)
LAYER_NUMBER = Int(1, MAX_LAYERS)
# The groups, by (mixer, feed-forward): (field listing the HF layers, KDA mixer, MoE feed-forward).
GROUPS = (("kda_dense_layers", True, False), ("kda_moe_layers", True, True),
          ("mla_dense_layers", False, False), ("mla_moe_layers", False, True))
# transformers' KimiLinearConfig defaults.
FULL_EVERY = 4
DENSE_FIRST = 1
DEFAULT_PAD = 163839


def _layer_types(f: Fields, linear: Fields | None, n: int) -> tuple[str, ...]:
    """``layer_types``, else the release's 1-based ``kda_layers`` / ``full_attn_layers``, else the default."""
    types: tuple[str, ...] | None = f.get("layer_types", LAYER_TYPES, None)
    if types is None and linear is not None and linear.has("kda_layers") and linear.has("full_attn_layers"):
        found: dict[int, str] = {}
        for key, kind in (("full_attn_layers", FULL), ("kda_layers", LINEAR)):
            for i, layer in enumerate(linear.get(key, List(LAYER_NUMBER))):
                require(layer <= n, linear.name(f"{key}[{i}]"), layer,
                        f"must number a layer (1-based) of num_hidden_layers = {n}")
                found[layer - 1] = kind
        missing = [i + 1 for i in range(n) if i not in found]
        require(not missing, linear.name("kda_layers"), missing, "layers in neither kda_layers nor full_attn_layers")
        types = tuple(found[i] for i in range(n))
    if types is None:
        types = tuple(FULL if i and i % FULL_EVERY == 0 else LINEAR for i in range(n))
    require(len(types) == n, f.name("layer_types"), list(types),
            f"must list one type per layer (num_hidden_layers = {n})")
    return types


def _mlp_types(f: Fields, n: int) -> tuple[str, ...]:
    types: tuple[str, ...] | None = f.get("mlp_layer_types", MLP_TYPES, None)
    if types is None:
        dense = f.get("first_k_dense_replace", Int(0, MAX_LAYERS), DENSE_FIRST)
        types = tuple(DENSE if i < dense else SPARSE for i in range(n))
    require(len(types) == n, f.name("mlp_layer_types"), list(types),
            f"must list one type per layer (num_hidden_layers = {n})")
    return types


def _refuse_unsupported(f: Fields) -> None:
    f.get("hidden_act", ACTIVATIONS, "silu")
    f.get("moe_router_activation_func", ROUTER_ACTIVATIONS, "sigmoid")
    if f.get("attention_bias", BOOL, False):
        raise ConfigError(f.name("attention_bias"), True, "Kimi-Linear attention biases are not supported")
    if not f.get("mla_use_nope", BOOL, True):
        raise ConfigError(f.name("mla_use_nope"), False, "Kimi-Linear's MLA with a rotary embedding is not "
                          "supported (transformers' rotates nothing)")


@dataclass(frozen=True)
class KimiLinearConfig:
    """A Kimi-Linear config as the model uses it (``to_dict()`` feeds the mapping's hooks and
    indices). The fixed fields are what the shared MLA and DeepSeek-MoE blocks read: no DSA indexer,
    no rotary embedding, sigmoid routing by groups."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    kda_dense_layers: tuple[int, ...]
    kda_moe_layers: tuple[int, ...]
    mla_dense_layers: tuple[int, ...]
    mla_moe_layers: tuple[int, ...]
    pad_token_id: int | None
    topk_method: str = "noaux_tc"
    sigmoid_routing: bool = True
    rope_theta: float = 1.0
    rope_scaling: dict[str, Any] | None = None
    rope_interleave: bool = False
    index_topk: int | None = None
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_rope_interleave: bool = False

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def linear_dim(self) -> int:
        """Channels of one of the KDA projections (query, key or value): ``heads * head_dim``."""
        return self.linear_num_heads * self.linear_head_dim

    def groups(self) -> tuple[tuple[str, bool, bool], ...]:
        """The :data:`GROUPS` that have layers."""
        return tuple(g for g in GROUPS if getattr(self, g[0]))

    def layer_order(self) -> tuple[str, ...]:
        """Each HF layer's group, in layer order."""
        return tuple(next(g for g, kda, moe in GROUPS if (t == LINEAR, m == SPARSE) == (kda, moe))
                     for t, m in zip(self.layer_types, self.mlp_layer_types, strict=True))

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> KimiLinearConfig:
        """Parse and check ``config.json`` (absent fields take transformers' defaults)."""
        f = Fields(hf)
        _refuse_unsupported(f)
        linear = f.object("linear_attn_config")
        n = f.get("num_hidden_layers", LAYERS, 27)
        heads = f.get("num_attention_heads", HEADS, 32)
        kv_heads = f.get("num_key_value_heads", HEADS, heads)
        require(kv_heads == heads, f.name("num_key_value_heads"), kv_heads,
                f"must equal num_attention_heads ({heads}): Kimi-Linear's MLA has a key and value per head")
        experts_field, experts = f.first(("num_experts", "num_local_experts"), EXPERTS, 256)
        top_k_field, top_k = f.first(("num_experts_per_token", "num_experts_per_tok"), EXPERTS, 8)
        groups_field, n_group = f.first(("num_expert_group", "n_group"), EXPERTS, 1)
        require(experts % n_group == 0 and experts // n_group >= 2, f.name(groups_field), n_group,
                f"must divide {experts_field} ({experts}) into groups of at least 2 experts")
        topk_group = f.get("topk_group", EXPERTS, 1)
        require(topk_group <= n_group, f.name("topk_group"), topk_group, f"must be at most {groups_field} ({n_group})")
        require(top_k <= topk_group * experts // n_group, f.name(top_k_field), top_k,
                f"must be at most the experts of topk_group ({topk_group}) groups")
        types, mlp_types = _layer_types(f, linear, n), _mlp_types(f, n)
        vocab = f.get("vocab_size", VOCAB, 163840)

        def linear_field(key: str, nested: str, spec: Int, default: int) -> int:
            value: int = f.get(key, spec, default)
            return value if linear is None else int(linear.get(nested, spec, value))

        def layers(kda: bool, moe: bool) -> tuple[int, ...]:
            return tuple(i for i, (t, m) in enumerate(zip(types, mlp_types, strict=True))
                         if (t == LINEAR) == kda and (m == SPARSE) == moe)

        return cls(
            model_type=f.get("model_type", NAME),
            vocab_size=vocab,
            hidden_size=f.get("hidden_size", HIDDEN, 2304),
            intermediate_size=f.get("intermediate_size", INTERMEDIATE, 9216),
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE, 1024),
            num_hidden_layers=n,
            num_attention_heads=heads,
            q_lora_rank=f.get("q_lora_rank", HEAD_DIM, None),
            kv_lora_rank=f.get("kv_lora_rank", HEAD_DIM, 512),
            qk_nope_head_dim=f.get("qk_nope_head_dim", HEAD_DIM, 128),
            qk_rope_head_dim=f.get("qk_rope_head_dim", HEAD_DIM, 64),
            v_head_dim=f.get("v_head_dim", HEAD_DIM, 128),
            linear_num_heads=linear_field("linear_num_heads", "num_heads", HEADS, 32),
            linear_head_dim=linear_field("linear_head_dim", "head_dim", HEAD_DIM, 128),
            linear_conv_kernel_dim=linear_field("linear_conv_kernel_dim", "short_conv_kernel_size", CONV_TAPS, 4),
            num_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=f.first(("num_shared_experts", "n_shared_experts"), COUNT, 1)[1],
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=f.first(("moe_renormalize", "norm_topk_prob"), BOOL, True)[1],
            routed_scaling_factor=f.get("routed_scaling_factor", POSITIVE, 2.446),
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-5),
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
            layer_types=types,
            mlp_layer_types=mlp_types,
            kda_dense_layers=layers(True, False),
            kda_moe_layers=layers(True, True),
            mla_dense_layers=layers(False, False),
            mla_moe_layers=layers(False, True),
            pad_token_id=padding_idx(f, vocab, DEFAULT_PAD),
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value (and the derived sizes), for the mapping table's hooks and indices."""
        return {**dataclasses.asdict(self), "qk_head_dim": self.qk_head_dim, "linear_dim": self.linear_dim}

