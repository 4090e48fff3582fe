"""tunix's Qwen3 (``tunix.models.qwen3.model.Qwen3``, google-tunix 0.1.7): an NNX module, one
``layers.{i}`` subtree per layer (unscanned), projections ``[in, out]`` with heads split::

    embedder.input_embedding                 [vocab, embed]
    final_norm.w                             [embed]
    lm_head.w                                [embed, vocab]    (absent with use_tied_embedding)
    layers.{i}.input_layernorm.w             [embed]
    layers.{i}.post_attention_layernorm.w    [embed]
    layers.{i}.attn.q_proj.w                 [embed, q_heads, head_dim]
    layers.{i}.attn.k_proj.w                 [embed, kv_heads, head_dim]
    layers.{i}.attn.v_proj.w                 [embed, kv_heads, head_dim]
    layers.{i}.attn.o_proj.w                 [q_heads, head_dim, embed]
    layers.{i}.attn.q_norm.w                 [head_dim]
    layers.{i}.attn.k_norm.w                 [head_dim]
    layers.{i}.mlp.gate_proj.kernel          [embed, mlp]      (dense)
    layers.{i}.mlp.up_proj.kernel            [embed, mlp]      (dense)
    layers.{i}.mlp.down_proj.kernel          [mlp, embed]      (dense)
    layers.{i}.mlp.router.kernel             [embed, experts]  (MoE: num_experts set)
    layers.{i}.mlp.gate_proj                 [experts, embed, mlp]
    layers.{i}.mlp.up_proj                   [experts, embed, mlp]
    layers.{i}.mlp.down_proj                 [experts, mlp, embed]

The values are tunix's own loader's (``tunix.models.qwen3.params.create_model_from_safe_tensors``):
HF tensors transposed and head-split, nothing rescaled. MoE expert kernels are the per-expert HF
keys ``mlp.experts.{e}.*_proj.weight`` stacked on a leading experts axis (the ``{expert}``
placeholder, absent from the target: tunix's ``_stack_experts`` does the same with ``jnp.stack``),
each transposed to ``[in, out]``. Load with::

    model = otfload.load_params(checkpoint, lambda: Qwen3(config, rngs=nnx.Rngs(0)), tunix_qwen3.TABLE,
                                mesh=mesh)

Shardings come from the module's ``sharding`` metadata (tunix's ``ShardingConfig``: mesh axes
``fsdp`` and ``tp``). A tied checkpoint loaded into an untied model fills ``lm_head.w`` from the
embedding (the fallback), as transformers does. ``tests/tunix`` checks every leaf bitwise against
tunix's loader and the logits against transformers.
"""

from __future__ import annotations

from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
T = "layers.{layer}"
E = f"{L}.mlp.experts.{{expert}}"
TRANSPOSE = Transpose()

TABLE = MappingTable(
    rules=(
        Rule("embedder.input_embedding", "model.embed_tokens.weight"),
        Rule("final_norm.w", "model.norm.weight"),
        Rule("lm_head.w", "lm_head.weight", (TRANSPOSE,), fallbacks=("model.embed_tokens.weight",)),
        Rule(f"{T}.input_layernorm.w", f"{L}.input_layernorm.weight"),
        Rule(f"{T}.post_attention_layernorm.w", f"{L}.post_attention_layernorm.weight"),
        Rule(f"{T}.attn.q_proj.w", f"{L}.self_attn.q_proj.weight",
             (TRANSPOSE, Reshape(("hidden_size", "num_attention_heads", -1)))),
        Rule(f"{T}.attn.k_proj.w", f"{L}.self_attn.k_proj.weight",
             (TRANSPOSE, Reshape(("hidden_size", "num_key_value_heads", -1)))),
        Rule(f"{T}.attn.v_proj.w", f"{L}.self_attn.v_proj.weight",
             (TRANSPOSE, Reshape(("hidden_size", "num_key_value_heads", -1)))),
        Rule(f"{T}.attn.o_proj.w", f"{L}.self_attn.o_proj.weight",
             (TRANSPOSE, Reshape(("num_attention_heads", -1, "hidden_size")))),
        Rule(f"{T}.attn.q_norm.w", f"{L}.self_attn.q_norm.weight"),
        Rule(f"{T}.attn.k_norm.w", f"{L}.self_attn.k_norm.weight"),
        # dense MLP: nnx.Linear kernels
        Rule(f"{T}.mlp.gate_proj.kernel", f"{L}.mlp.gate_proj.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.up_proj.kernel", f"{L}.mlp.up_proj.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.down_proj.kernel", f"{L}.mlp.down_proj.weight", (TRANSPOSE,)),
        # MoE: the router is an nnx.Linear; the experts are bare Params stacked over {expert}
        Rule(f"{T}.mlp.router.kernel", f"{L}.mlp.gate.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.gate_proj", f"{E}.gate_proj.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.up_proj", f"{E}.up_proj.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.down_proj", f"{E}.down_proj.weight", (TRANSPOSE,)),
    ),
    ignore=(r".*rotary_emb\.inv_freq",),
)
