"""The Llama family's mapping table (Llama 3, Mistral, Qwen2, Qwen3) and the checks of a config
against the checkpoint's tensors; the MoE and Gemma tables extend them.

``lm_head.weight`` has no fallback: a tied model has no ``lm_head`` leaf, so an untied config
(``tie_word_embeddings`` false, transformers' default for these families) whose checkpoint lacks
``lm_head.weight`` is a missing tensor, never a silent copy of the embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.gqa_shape import attention_checks
from otfload.families.llama.config import LlamaConfig
from otfload.plan.hooks import Reshape
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"

LLAMA_TABLE = MappingTable(
    rules=(
        Rule("embed.embedding", "model.embed_tokens.weight"),
        Rule("final_norm.scale", "model.norm.weight"),
        Rule("lm_head.kernel", "lm_head.weight"),
        Rule("layers.{layer}.input_norm.scale", f"{L}.input_layernorm.weight"),
        Rule("layers.{layer}.post_attn_norm.scale", f"{L}.post_attention_layernorm.weight"),
        Rule("layers.{layer}.attn.q.kernel", f"{L}.self_attn.q_proj.weight",
             (Reshape(("num_attention_heads", "head_dim", "hidden_size")),)),
        Rule("layers.{layer}.attn.k.kernel", f"{L}.self_attn.k_proj.weight",
             (Reshape(("num_key_value_heads", "head_dim", "hidden_size")),)),
        Rule("layers.{layer}.attn.v.kernel", f"{L}.self_attn.v_proj.weight",
             (Reshape(("num_key_value_heads", "head_dim", "hidden_size")),)),
        Rule("layers.{layer}.attn.o.kernel", f"{L}.self_attn.o_proj.weight",
             (Reshape(("hidden_size", "num_attention_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.q.bias", f"{L}.self_attn.q_proj.bias",
             (Reshape(("num_attention_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.k.bias", f"{L}.self_attn.k_proj.bias",
             (Reshape(("num_key_value_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.v.bias", f"{L}.self_attn.v_proj.bias",
             (Reshape(("num_key_value_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.o.bias", f"{L}.self_attn.o_proj.bias"),
        Rule("layers.{layer}.attn.q_norm.scale", f"{L}.self_attn.q_norm.weight"),
        Rule("layers.{layer}.attn.k_norm.scale", f"{L}.self_attn.k_norm.weight"),
        Rule("layers.{layer}.mlp.gate.kernel", f"{L}.mlp.gate_proj.weight"),
        Rule("layers.{layer}.mlp.up.kernel", f"{L}.mlp.up_proj.weight"),
        Rule("layers.{layer}.mlp.down.kernel", f"{L}.mlp.down_proj.weight"),
        Rule("layers.{layer}.mlp.gate.bias", f"{L}.mlp.gate_proj.bias"),
        Rule("layers.{layer}.mlp.up.bias", f"{L}.mlp.up_proj.bias"),
        Rule("layers.{layer}.mlp.down.bias", f"{L}.mlp.down_proj.bias"),
    ),
    ignore=(r".*\.rotary_emb\.inv_freq",),
)


def llama_checks(cfg: LlamaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The Llama family's checks: :func:`attention_checks` of the top-level model."""
    return attention_checks(cfg)
