"""OLMo 3's mapping table and checks: the Llama-style keys with OLMo's two post-norms and its q/k
norms over whole projections (HF ``[heads * head_dim]``, reshaped to the leaves' ``(heads,
head_dim)``). Tied configs build no ``lm_head`` leaf; an untied one without ``lm_head.weight`` is
a missing tensor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.olmo3.config import Olmo3Config
from otfload.plan.hooks import Reshape
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
A = f"{L}.self_attn"
HEADS = ("num_attention_heads", "head_dim")
KV_HEADS = ("num_key_value_heads", "head_dim")


def _attention_rules() -> list[Rule]:
    rules = [Rule("layers.{layer}.attn.o.kernel", f"{A}.o_proj.weight", (Reshape(("hidden_size", *HEADS)),)),
             Rule("layers.{layer}.attn.o.bias", f"{A}.o_proj.bias")]
    for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        rules += [
            Rule(f"layers.{{layer}}.attn.{name}.kernel", f"{A}.{name}_proj.weight",
                 (Reshape((*heads, "hidden_size")),)),
            Rule(f"layers.{{layer}}.attn.{name}.bias", f"{A}.{name}_proj.bias", (Reshape(heads),)),
        ]
    rules += [Rule("layers.{layer}.attn.q_norm.scale", f"{A}.q_norm.weight", (Reshape(HEADS),)),
              Rule("layers.{layer}.attn.k_norm.scale", f"{A}.k_norm.weight", (Reshape(KV_HEADS),))]
    return rules


OLMO3_TABLE = MappingTable(
    rules=(
        Rule("embed.embedding", "model.embed_tokens.weight"),
        Rule("final_norm.scale", "model.norm.weight"),
        Rule("lm_head.kernel", "lm_head.weight"),
        Rule("layers.{layer}.post_attn_norm.scale", f"{L}.post_attention_layernorm.weight"),
        Rule("layers.{layer}.post_ffw_norm.scale", f"{L}.post_feedforward_layernorm.weight"),
        *_attention_rules(),
        *(Rule(f"layers.{{layer}}.mlp.{n}.kernel", f"{L}.mlp.{n}_proj.weight") for n in ("gate", "up", "down")),
    ),
    ignore=(r".*\.rotary_emb\.inv_freq",),
)


def olmo3_checks(cfg: Olmo3Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary, width and (kv) heads against the tensors."""
    embed, per_head = "model.embed_tokens.weight", ("head_dim", cfg.head_dim)
    return (
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
        Dim("vocab_size", cfg.vocab_size, embed, 0),
        Dim("hidden_size", cfg.hidden_size, embed, 1),
        Dim("num_attention_heads", cfg.num_attention_heads, f"{A}.q_proj.weight", 0, per_head),
        Dim("num_key_value_heads", cfg.num_key_value_heads, f"{A}.k_proj.weight", 0, per_head),
    )
