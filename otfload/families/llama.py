"""Mapping table for the Llama family (Llama 3, Mistral, Qwen2, Qwen3)."""

from __future__ import annotations

from otfload.families.registry import Family, register
from otfload.models.llama import LlamaConfig, LlamaForCausalLM
from otfload.plan.hooks import Reshape
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"

LLAMA_TABLE = MappingTable(
    rules=(
        Rule("embed.embedding", "model.embed_tokens.weight"),
        Rule("final_norm.scale", "model.norm.weight"),
        Rule("lm_head.kernel", "lm_head.weight", fallbacks=("model.embed_tokens.weight",)),
        Rule("layers.{layer}.input_norm.scale", f"{L}.input_layernorm.weight"),
        Rule("layers.{layer}.post_attn_norm.scale", f"{L}.post_attention_layernorm.weight"),
        Rule("layers.{layer}.attn.q.kernel", f"{L}.self_attn.q_proj.weight",
             (Reshape(("num_heads", "head_dim", "hidden_size")),)),
        Rule("layers.{layer}.attn.k.kernel", f"{L}.self_attn.k_proj.weight",
             (Reshape(("num_kv_heads", "head_dim", "hidden_size")),)),
        Rule("layers.{layer}.attn.v.kernel", f"{L}.self_attn.v_proj.weight",
             (Reshape(("num_kv_heads", "head_dim", "hidden_size")),)),
        Rule("layers.{layer}.attn.o.kernel", f"{L}.self_attn.o_proj.weight",
             (Reshape(("hidden_size", "num_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.q.bias", f"{L}.self_attn.q_proj.bias", (Reshape(("num_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.k.bias", f"{L}.self_attn.k_proj.bias", (Reshape(("num_kv_heads", "head_dim")),)),
        Rule("layers.{layer}.attn.v.bias", f"{L}.self_attn.v_proj.bias", (Reshape(("num_kv_heads", "head_dim")),)),
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

LLAMA = register(
    Family(
        name="llama",
        model_types=("llama", "mistral", "qwen2", "qwen3"),
        parse_config=LlamaConfig.from_hf,
        build=LlamaForCausalLM,
        mapping=lambda cfg: LLAMA_TABLE,
    )
)
