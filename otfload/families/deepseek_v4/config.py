"""DeepSeek-V4 (``deepseek_v4``) config: every field of the published ``config.json`` (V4-Flash) and
of transformers 5.24's ``DeepseekV4Config`` read, checked and normalised as transformers reads them;
what otfload does not implement is a :class:`~otfload.errors.ConfigError` naming the field and value.

Normalised as transformers does: ``layer_types`` from the explicit list, else from the legacy
per-layer ``compress_ratios`` (0 sliding, 4 CSA, 128 HCA; a published list one longer than the layers
carries the MTP layer's entry), else the V4-Pro default; ``compress_rates`` with the legacy
``compress_rate_csa`` / ``compress_rate_hca`` folded in; ``mlp_layer_types`` from the explicit list,
else ``num_hash_layers`` hash-routed layers then top-k ones; the rotary dims from
``partial_rotary_factor`` or the legacy ``qk_rope_head_dim``; two RoPEs: ``main`` (sliding layers:
plain RoPE of ``rope_theta``) and ``compress`` (compressed layers and their compressors:
``compress_rope_theta`` with the top-level ``rope_scaling``, YaRN's attention factor 1), or the
nested ``rope_parameters: {"main": ..., "compress": ...}`` transformers writes back.

Refused (each by its field): attention or MLP biases, activations other than SiLU, more than one KV
head or shared expert (transformers builds one of each whatever the config says), router scores other
than ``sqrtsoftplus`` / ``sigmoid`` / ``softmax``, ``norm_topk_prob`` false and ``topk_method`` other
than ``noaux_tc`` (transformers normalises and routes so regardless), and rotary dims that differ
between the two RoPEs. ``expert_dtype`` (top level, or in ``quantization_config`` where transformers
moves it) is checked against its values and otherwise not read: the published layout (``fp4`` routed
experts, FP8 elsewhere, UE8M0 ``.scale`` tensors) is decoded by the index's ``fp8`` method, decided by
the tensors present, like any other.
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
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    POSITIVE,
    VOCAB,
    WINDOW,
    Choice,
    Fields,
    Float,
    Int,
    List,
    padding_idx,
    require,
    rope_kind,
)
from otfload.config.fields import MAX_LAYERS, REQUIRED
from otfload.config.rope import FRACTION, THETA
from otfload.errors import ConfigError

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
# The legacy per-layer ``compress_ratios`` values transformers knows (any other is its KeyError).
RATIO_KINDS = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_RATES = {CSA: 4, HCA: 128}
SHORT = {SLIDING: "sliding", CSA: "csa", HCA: "hca", HASH_MOE: "hash", MOE: "moe"}
GROUPS = tuple(f"{SHORT[a]}_{SHORT[m]}_layers" for a in LAYER_TYPES for m in MLP_LAYER_TYPES)
# Groups a config does not have read no HF layer.
ALL_GROUPS: dict[str, tuple[int, ...]] = dict.fromkeys(GROUPS, ())
SCORING = ("sqrtsoftplus", "sigmoid")  # transformers has no "softmax" activation: its V4 fails on it
COUNT = Int(0, MAX_LAYERS)
EXPERT_DTYPES = Choice("fp8", "fp4", "bf16", "bfloat16")
RATE = Int(1, 1 << 20)
HC = Int(1, 64)
ITERS = Int(1, 1000)
# The defaults of transformers' DeepseekV4Config (V4-Flash's sizes).
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "num_experts_per_tok": 6,
    "n_routed_experts": 256, "routed_scaling_factor": 1.5, "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0, "sliding_window": 128,
    "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512,
    "num_nextn_predict_layers": 1, "rms_norm_eps": 1e-6, "num_hash_layers": 3, "partial_rotary_factor": 64 / 512,
}


@dataclass(frozen=True)
class Rope:
    """One of V4's two RoPEs: base, scaling (None: plain) as :func:`~otfload.models.layers.rope_inv_freq`
    reads it."""

    theta: float
    scaling: dict[str, Any] | None


@dataclass(frozen=True)
class DeepseekV4Config:
    """The fields the DeepSeek-V4 model reads, under ``config.json``'s names (``num_experts`` is
    ``n_routed_experts``); ``layer_types`` / ``mlp_layer_types`` per layer, normalised."""

    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    qk_rope_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    scoring_func: str
    routed_scaling_factor: float
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    main_rope: Rope
    compress_rope: Rope
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    mtp_layers: int
    pad_token_id: int | None

    @property
    def compress_rates(self) -> dict[str, int]:
        return {CSA: self.compress_rate_csa, HCA: self.compress_rate_hca}

    @property
    def layer_order(self) -> tuple[str, ...]:
        """Each HF layer's group: :func:`group_name` of its attention and MLP kinds."""
        return tuple(group_name(a, m) for a, m in zip(self.layer_types, self.mlp_layer_types, strict=True))

    @property
    def layer_groups(self) -> dict[str, tuple[int, ...]]:
        """Each group present → its HF layers, in order (what the mapping's ``indices`` read)."""
        groups: dict[str, list[int]] = {}
        for i, group in enumerate(self.layer_order):
            groups.setdefault(group, []).append(i)
        return {group: tuple(layers) for group, layers in groups.items()}

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, and each group's HF layers, for the mapping table's hooks."""
        return {**dataclasses.asdict(self), **ALL_GROUPS, **self.layer_groups}


def group_name(attention: str, mlp: str) -> str:
    """The layer group of an attention kind and an MLP kind (``csa_hash_layers``, ...)."""
    return f"{SHORT[attention]}_{SHORT[mlp]}_layers"


def _get(f: Fields, key: str, spec: Any) -> Any:
    return f.get(key, spec, DEFAULTS.get(key, REQUIRED))


def _layer_types(f: Fields, layers: int) -> tuple[str, ...]:
    if f.has("layer_types"):
        types: tuple[str, ...] = f.get("layer_types", List(Choice(*LAYER_TYPES)))
        field = "layer_types"
    elif f.has("compress_ratios"):
        ratios = f.get("compress_ratios", List(Int(0, 1 << 20)))
        for i, r in enumerate(ratios):
            if r not in RATIO_KINDS:
                raise ConfigError(f"compress_ratios[{i}]", r, f"must be one of {sorted(RATIO_KINDS)} "
                                  "(sliding, compressed sparse, heavily compressed: as transformers reads them)")
        types, field = tuple(RATIO_KINDS[r] for r in ratios), "compress_ratios"
    else:  # transformers' default: two HCA layers, then CSA / HCA alternating
        return tuple([HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))])
    require(len(types) >= layers, field, f.data[field], f"must give at least num_hidden_layers ({layers}) layers")
    return types[:layers]


def _mlp_layer_types(f: Fields, layers: int) -> tuple[str, ...]:
    if f.has("mlp_layer_types"):
        types: tuple[str, ...] = f.get("mlp_layer_types", List(Choice(*MLP_LAYER_TYPES)))
        require(len(types) >= layers, "mlp_layer_types", types, f"must give at least num_hidden_layers ({layers})")
        return types[:layers]
    hashed = _get(f, "num_hash_layers", COUNT)
    return tuple([HASH_MOE] * min(layers, hashed) + [MOE] * max(0, layers - hashed))


def _rope(f: Fields, key: str, theta: float, flat: dict[str, Any] | None) -> tuple[Rope, float | None]:
    """One RoPE and its ``partial_rotary_factor`` (None: not given): the nested ``rope_parameters[key]``
    when given, else ``theta`` with the flat scaling (YaRN with attention factor 1, as transformers)."""
    params = f.object("rope_parameters")
    nested = None if params is None else params.object(key)
    if nested is not None:
        kind = rope_kind(nested)
        theta = nested.get("rope_theta", THETA, theta)
        factor = nested.get("partial_rotary_factor", FRACTION, None)
        return Rope(theta, None if kind == "default" else dict(nested.data)), factor
    if flat is None:
        return Rope(theta, None), None
    return Rope(theta, {"attention_factor": 1.0, **flat} if rope_kind(Fields(flat)) == "yarn" else flat), None


def _flat_scaling(f: Fields) -> dict[str, Any] | None:
    """The top-level scaling transformers gives the compressed RoPE: ``rope_scaling``, or a flat
    ``rope_parameters`` (not the nested ``main`` / ``compress`` form)."""
    for key in ("rope_scaling", "rope_parameters"):
        obj = f.object(key)
        if obj is None or "main" in obj.data or "compress" in obj.data:
            continue
        kind = rope_kind(obj)
        if kind != "default":
            return {k: v for k, v in obj.data.items() if k != "rope_theta"}
    return None


def deepseek_v4_config(hf: Mapping[str, Any]) -> DeepseekV4Config:
    """Parse and check a DeepSeek-V4 ``config.json`` (absent fields: transformers' defaults)."""
    f = Fields(hf)
    f.get("model_type", Choice("deepseek_v4"))
    for flag in ("attention_bias", "mlp_bias"):
        if f.get(flag, BOOL, False):
            raise ConfigError(flag, True, "deepseek_v4 with biases is not supported (transformers' V4 has none)")
    f.get("hidden_act", Choice("silu"), "silu")
    require(f.get("num_key_value_heads", HEADS, 1) == 1, "num_key_value_heads", f.data.get("num_key_value_heads"),
            "must be 1: V4 attends with one shared key-value head (transformers builds one whatever this says)")
    require(f.get("n_shared_experts", Int(0, 1 << 10), 1) == 1, "n_shared_experts", f.data.get("n_shared_experts"),
            "must be 1: transformers' V4 builds one shared expert of moe_intermediate_size whatever this says")
    require(f.get("norm_topk_prob", BOOL, True), "norm_topk_prob", False,
            "must be true: transformers' V4 always normalises the chosen experts' weights")
    f.get("topk_method", Choice("noaux_tc"), "noaux_tc")
    f.get("expert_dtype", EXPERT_DTYPES, None)
    quant = f.object("quantization_config")
    if quant is not None:
        quant.get("expert_dtype", EXPERT_DTYPES, None)

    layers = _get(f, "num_hidden_layers", LAYERS)
    heads = _get(f, "num_attention_heads", HEADS)
    head_dim = _get(f, "head_dim", HEAD_DIM)
    experts = _get(f, "n_routed_experts", EXPERTS)
    top_k = _get(f, "num_experts_per_tok", EXPERTS)
    require(top_k <= experts, "num_experts_per_tok", top_k, f"must be at most n_routed_experts ({experts})")

    flat = _flat_scaling(f)
    main, main_factor = _rope(f, "main", _get(f, "rope_theta", THETA), None)
    compress, compress_factor = _rope(f, "compress", _get(f, "compress_rope_theta", THETA), flat)
    if f.has("partial_rotary_factor"):
        factor = f.get("partial_rotary_factor", FRACTION)
    elif f.has("qk_rope_head_dim"):
        factor = f.get("qk_rope_head_dim", Int(2, head_dim)) / head_dim
    else:
        factor = DEFAULTS["partial_rotary_factor"]
    factors = {main_factor or factor, compress_factor or factor}
    require(len(factors) == 1, "rope_parameters", f.data.get("rope_parameters"),
            "main and compress must rotate the same dims (one partial_rotary_factor)")
    rope_dim = int(head_dim * factor)
    require(rope_dim % 2 == 0 and 2 <= rope_dim <= head_dim, "partial_rotary_factor", factor,
            f"must give an even number of rotated dims, at most head_dim ({head_dim} -> {rope_dim})")

    rates = dict(DEFAULT_RATES)
    given = f.object("compress_rates")
    if given is not None:
        for key in given.data:
            require(key in DEFAULT_RATES, f"compress_rates.{key}", given.data[key],
                    f"keys must be {tuple(DEFAULT_RATES)}")
            rates[key] = given.get(key, RATE)
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        rates[kind] = f.get(legacy, RATE, rates[kind])

    o_groups = _get(f, "o_groups", HEADS)
    require(heads % o_groups == 0, "o_groups", o_groups, f"must divide num_attention_heads ({heads})")
    index_head_dim = _get(f, "index_head_dim", HEAD_DIM)
    require(index_head_dim >= rope_dim, "index_head_dim", index_head_dim, f"must hold the {rope_dim} rotated dims")
    scoring = f.get("scoring_func", Choice(*SCORING), "sqrtsoftplus")
    vocab = _get(f, "vocab_size", VOCAB)
    return DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=_get(f, "hidden_size", HIDDEN),
        moe_intermediate_size=_get(f, "moe_intermediate_size", INTERMEDIATE),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        q_lora_rank=_get(f, "q_lora_rank", HEAD_DIM),
        qk_rope_head_dim=rope_dim,
        num_experts=experts,
        num_experts_per_tok=top_k,
        scoring_func=scoring,
        routed_scaling_factor=_get(f, "routed_scaling_factor", POSITIVE),
        layer_types=_layer_types(f, layers),
        mlp_layer_types=_mlp_layer_types(f, layers),
        compress_rate_csa=rates[CSA],
        compress_rate_hca=rates[HCA],
        main_rope=main,
        compress_rope=compress,
        hc_mult=_get(f, "hc_mult", HC),
        hc_sinkhorn_iters=_get(f, "hc_sinkhorn_iters", ITERS),
        hc_eps=_get(f, "hc_eps", Float(0.0, 1.0)),
        swiglu_limit=_get(f, "swiglu_limit", POSITIVE),
        sliding_window=_get(f, "sliding_window", WINDOW),
        o_groups=o_groups,
        o_lora_rank=_get(f, "o_lora_rank", HEAD_DIM),
        index_n_heads=_get(f, "index_n_heads", HEADS),
        index_head_dim=index_head_dim,
        index_topk=_get(f, "index_topk", WINDOW),
        rms_norm_eps=_get(f, "rms_norm_eps", EPS),
        tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
        mtp_layers=_get(f, "num_nextn_predict_layers", COUNT),
        pad_token_id=padding_idx(f, vocab),
    )
