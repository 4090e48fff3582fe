"""Mapping rules that decoder families share, from the HF keys transformers writes for a
Llama-style decoder: the model-level leaves (embeddings, final norm, ``lm_head``), a layer's two
norms, a gated MLP's ``gate``/``up``/``down`` projections, DeepSeek-style routed experts with a
correction-biased router and shared experts, and the whole Llama-style table that several families
extend. A rule whose tensor a checkpoint lacks (biases, ``lm_head`` of a tied model) matches no
leaf the model builds without it. Attention rules are in :mod:`otfload.families.gqa_rules`."""

from __future__ import annotations

from collections.abc import Callable

from otfload.families.gqa_rules import gqa_rules
from otfload.plan.mapping import MappingTable, Rule

HF_LAYER = "model.layers.{layer}"
# transformers saves no RoPE buffer, but older checkpoints do: never a weight.
IGNORE_ROPE_BUFFERS = (r".*\.rotary_emb\.inv_freq",)
MODEL_RULES = (
    Rule("embed.embedding", "model.embed_tokens.weight"),
    Rule("final_norm.scale", "model.norm.weight"),
    Rule("lm_head.kernel", "lm_head.weight"),
)
GATED_MLP = ("gate", "up", "down")


def norm_rules(target: str, source: str, rule: Callable[..., Rule] = Rule) -> list[Rule]:
    """A layer's ``input_norm`` and ``post_attn_norm`` under ``target`` from the HF layer ``source``."""
    return [rule(f"{target}.input_norm.scale", f"{source}.input_layernorm.weight"),
            rule(f"{target}.post_attn_norm.scale", f"{source}.post_attention_layernorm.weight")]


def mlp_rules(target: str, source: str, rule: Callable[..., Rule] = Rule, *, biases: bool = False) -> list[Rule]:
    """A gated MLP's kernels (and, with ``biases``, biases) under ``target`` from ``source``'s
    ``{gate,up,down}_proj``."""
    kinds = ("weight", "bias") if biases else ("weight",)
    return [rule(f"{target}.{name}.{'kernel' if kind == 'weight' else 'bias'}", f"{source}.{name}_proj.{kind}")
            for kind in kinds for name in GATED_MLP]


def routed_rules(target: str, source: str, rule: Callable[..., Rule] = Rule) -> list[Rule]:
    """DeepSeek-V3-style routed experts under ``target`` (``….moe``) from the HF ``source``
    (``….mlp``): the router and its ``e_score_correction_bias``, per-expert projections stacked on
    the ``experts`` axis by the ``{expert}`` placeholder (absent from the target), shared experts."""
    return [rule(f"{target}.router.kernel", f"{source}.gate.weight"),
            rule(f"{target}.router.bias", f"{source}.gate.e_score_correction_bias"),
            *mlp_rules(f"{target}.experts", f"{source}.experts.{{expert}}", rule),
            *mlp_rules(f"{target}.shared", f"{source}.shared_experts", rule)]


def decoder_table(*layer_rules: Rule, ignore: tuple[str, ...] = IGNORE_ROPE_BUFFERS) -> MappingTable:
    """A table of the model-level rules plus ``layer_rules``."""
    return MappingTable(rules=(*MODEL_RULES, *layer_rules), ignore=ignore)


L = "layers.{layer}"
# Llama 3, Mistral, Qwen2/3 as they are, and the base of the Gemma, Mixtral, Qwen3-MoE and GPT-OSS tables.
LLAMA_STYLE_TABLE = decoder_table(*norm_rules(L, HF_LAYER), *gqa_rules(f"{L}.attn", f"{HF_LAYER}.self_attn"),
                                  *mlp_rules(f"{L}.mlp", f"{HF_LAYER}.mlp", biases=True))
