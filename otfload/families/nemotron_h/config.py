"""Nemotron-H's config (``nemotron_h``: Nemotron-3, ``NemotronHForCausalLM``): ``config.json`` parsed
and checked into a :class:`NemotronHConfig`.

Each layer is one block, a Mamba-2 mixer (``linear_attention``), GQA attention (``full_attention``),
an ungated squared-ReLU MLP (``mlp``) or routed experts (``moe``), in the order ``layers_block_type``
gives, or the older ``hybrid_override_pattern`` (``M``, ``*``, ``-``, ``E``; transformers' default
when neither is given: one of each, Mamba, MoE, attention, MLP). The four kinds are groups of their
own shapes, whose HF layers are the config lists ``mamba_layers``, ``attention_layers``,
``mlp_layers`` and ``moe_layers`` the mapping indexes by. The number of layers is the list's length
(transformers ignores ``num_hidden_layers``). The older names of the Mamba fields (``mamba_n_groups``,
``mamba_d_conv``, ``mamba_dt_min``, ``mamba_conv_bias``, ``mamba_chunk_size``) are read as
transformers reads them. Attention has no positional encoding (transformers' ``NemotronHAttention``
applies none: ``rope_theta`` and ``partial_rotary_factor`` are unused), and the output projection is
never tied to the embedding (transformers' model ties none). Like transformers' model, the Mamba
projections' bias follows ``use_bias`` (``mamba_proj_bias`` is unused), the shared expert is one MLP
of ``moe_shared_expert_intermediate_size`` whatever ``n_shared_experts`` says, residuals stay in the
activation dtype (``residual_in_fp32`` is unused) and the time step is clamped at ``time_step_min``
only (``time_step_limit`` is unused).

Refused by name: an unknown block kind or pattern letter, another Mamba activation than SiLU
(``mamba_hidden_act``), another MLP activation than ``relu2`` (``mlp_hidden_act``), a state dtype
other than float32 (``mamba_ssm_cache_dtype``), attention biases, a sliding window, heads not a
multiple of ``n_groups``, experts not in equal groups of at least two (``n_group``). A
``moe_latent_size`` (Nemotron-3 Super's latent MoE) runs the routed experts in that latent width
between ``fc1_latent_proj`` and ``fc2_latent_proj``, as transformers does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EPS,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    INTERMEDIATE,
    NAME,
    POSITIVE,
    VOCAB,
    Choice,
    Fields,
    Int,
    List,
    Str,
    require,
)
from otfload.config.fields import MAX_LAYERS
from otfload.errors import ConfigError
from otfload.families.gqa_shape import attention_shape

MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
# block kind -> the config list of its HF layers (the layer group)
GROUP_OF = {MAMBA: "mamba_layers", ATTENTION: "attention_layers", MLP: "mlp_layers", MOE: "moe_layers"}
BLOCK_TYPES = List(Choice(*GROUP_OF))
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
DEFAULT_BLOCKS = (MAMBA, MOE, ATTENTION, MLP)
CONV_TAPS = Int(1, 64)
STATE = Int(1, 1 << 12)
CHUNK = Int(1, 1 << 14)


def _block_types(f: Fields) -> tuple[str, ...]:
    """Each layer's block kind, from ``layers_block_type`` (alias ``layer_types``), else
    ``hybrid_override_pattern``, else transformers' default."""
    key, types = f.first(("layers_block_type", "layer_types"), BLOCK_TYPES, None)
    if types is None and f.has("hybrid_override_pattern"):
        pattern = f.get("hybrid_override_pattern", Str())
        unknown = sorted(set(pattern) - set(PATTERN))
        if unknown:
            raise ConfigError(f.name("hybrid_override_pattern"), pattern,
                              f"has block letters {unknown}; known: {', '.join(PATTERN)}")
        types = tuple(PATTERN[c] for c in pattern)
    types = DEFAULT_BLOCKS if types is None else types
    require(0 < len(types) <= MAX_LAYERS, f.name(key), list(types), f"must list 1 to {MAX_LAYERS} layers")
    return types


def _layers(types: tuple[str, ...], kind: str) -> tuple[int, ...]:
    return tuple(i for i, t in enumerate(types) if t == kind)


@dataclass(frozen=True)
class NemotronHConfig:
    """A Nemotron-H config as the model uses it, under the config's names (``to_dict()`` feeds the
    mapping's hooks and indices), except ``num_experts`` (``n_routed_experts``). The fixed fields are
    what the shared attention and routing blocks read: attention without biases, q/k norms or RoPE;
    sigmoid routing with the correction bias."""

    model_type: str
    vocab_size: int
    hidden_size: int
    layers_block_type: tuple[str, ...]
    num_hidden_layers: int
    mamba_layers: tuple[int, ...]
    attention_layers: tuple[int, ...]
    mlp_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mlp_bias: bool
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool
    chunk_size: int
    time_step_min: float
    layer_norm_epsilon: float
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    moe_shared_expert_intermediate_size: int
    moe_latent_size: int | None
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    # No embedding row is kept out of training: transformers' embedding has no ``padding_idx``.
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sigmoid_routing: bool = True
    topk_method: str = "noaux_tc"

    @property
    def rms_norm_eps(self) -> float:
        """The attention block's norm epsilon (it has no q/k norms; the blocks' norms use
        ``layer_norm_epsilon``)."""
        return self.layer_norm_epsilon

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> NemotronHConfig:
        """Parse and check ``config.json`` (absent fields take transformers' Nemotron-H defaults)."""
        f = Fields(hf)
        types = _block_types(f)
        f.get("mamba_hidden_act", Choice("silu"), "silu")
        f.get("mlp_hidden_act", Choice("relu2"), "relu2")
        f.get("mamba_ssm_cache_dtype", Choice("float32"), "float32")
        for name, spec, off in (("attention_bias", BOOL, False), ("sliding_window", Int(1), None)):
            value = f.get(name, spec, off)
            if value != off:
                raise ConfigError(f.name(name), value, "is not supported for Nemotron-H")
        hidden, heads, kv_heads, head_dim = attention_shape(f)
        m_heads = f.get("mamba_num_heads", HEADS, 128)
        groups_key, groups = f.first(("mamba_n_groups", "n_groups"), HEADS, 8)
        require(m_heads % groups == 0, f.name(groups_key), groups,
                f"must divide mamba_num_heads ({m_heads}): each group serves whole heads")
        _, experts = f.first(("n_routed_experts", "num_local_experts"), EXPERTS, 8)
        n_group = f.get("n_group", Int(1, experts), 1)
        require(experts % n_group == 0 and (n_group == 1 or experts // n_group >= 2), f.name("n_group"), n_group,
                f"must split the {experts} routed experts into equal groups of at least two")
        vocab = f.get("vocab_size", VOCAB, 131072)
        return cls(
            model_type=f.get("model_type", NAME),
            vocab_size=vocab,
            hidden_size=hidden,
            layers_block_type=types,
            num_hidden_layers=len(types),
            mamba_layers=_layers(types, MAMBA),
            attention_layers=_layers(types, ATTENTION),
            mlp_layers=_layers(types, MLP),
            moe_layers=_layers(types, MOE),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE, 21504),
            mlp_bias=f.get("mlp_bias", BOOL, False),
            mamba_num_heads=m_heads,
            mamba_head_dim=f.get("mamba_head_dim", HEAD_DIM, 64),
            n_groups=groups,
            ssm_state_size=f.get("ssm_state_size", STATE, 128),
            conv_kernel=f.first(("mamba_d_conv", "conv_kernel"), CONV_TAPS, 4)[1],
            use_conv_bias=f.first(("mamba_conv_bias", "use_conv_bias"), BOOL, True)[1],
            use_bias=f.get("use_bias", BOOL, False),
            chunk_size=f.first(("mamba_chunk_size", "chunk_size"), CHUNK, 128)[1],
            time_step_min=f.first(("mamba_dt_min", "time_step_min"), POSITIVE, 0.001)[1],
            layer_norm_epsilon=f.get("layer_norm_epsilon", EPS, 1e-5),
            num_experts=experts,
            num_experts_per_tok=f.get("num_experts_per_tok", Int(1, experts), min(2, experts)),
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE, 7688),
            moe_shared_expert_intermediate_size=f.get("moe_shared_expert_intermediate_size", INTERMEDIATE, 7688),
            moe_latent_size=f.get("moe_latent_size", INTERMEDIATE, None),
            n_shared_experts=f.get("n_shared_experts", Int(0, EXPERTS.max), 1),
            n_group=n_group,
            topk_group=f.get("topk_group", Int(1, n_group), 1),
            norm_topk_prob=f.get("norm_topk_prob", BOOL, True),
            routed_scaling_factor=f.get("routed_scaling_factor", POSITIVE, 1.0),
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, for the mapping table's hooks and indices."""
        return dataclasses.asdict(self)
