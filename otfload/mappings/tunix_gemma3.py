"""tunix's Gemma3 text model (``tunix.models.gemma3.model.Gemma3``, google-tunix 0.1.7): an NNX
module, one ``layers.{i}`` subtree per layer (unscanned), einsum weights with heads split, the
embedding tied to the logits::

    embedder.input_embedding                 [vocab, embed]
    final_norm.scale                         [embed]
    layers.{i}.pre_attention_norm.scale      [embed]
    layers.{i}.post_attention_norm.scale     [embed]
    layers.{i}.pre_ffw_norm.scale            [embed]
    layers.{i}.post_ffw_norm.scale           [embed]
    layers.{i}.attn.q_einsum.w               [q_heads, embed, head_dim]        (q_heads != kv_heads)
    layers.{i}.attn.kv_einsum.w              [2, kv_heads, embed, head_dim]    (k, v)
    layers.{i}.attn.qkv_einsum.w             [3, q_heads, embed, head_dim]     (q, k, v; q_heads == kv_heads)
    layers.{i}.attn.attn_vec_einsum.w        [q_heads, head_dim, embed]
    layers.{i}.attn._query_norm.scale        [head_dim]
    layers.{i}.attn._key_norm.scale          [head_dim]
    layers.{i}.mlp.gate_proj.kernel          [embed, mlp]
    layers.{i}.mlp.up_proj.kernel            [embed, mlp]
    layers.{i}.mlp.down_proj.kernel          [mlp, embed]

The values are tunix's own loader's (``tunix.models.gemma3.params_safetensors``), bit for bit: HF
tensors transposed and head-split, nothing rescaled — the norms keep HF's zero-centred scales
(tunix's ``RMSNorm`` multiplies by ``1 + scale`` as transformers does) and the embedding stays
unscaled (``Embedder.encode`` multiplies by ``sqrt(embed)`` at run time). The fused ``kv_einsum.w``
and ``qkv_einsum.w`` stack *different* HF tensors on their leading axis: their rules name the parts
(``indices={"part": ("k", "v")}``, ``("q", "k", "v")``), and ``{part}``, absent from the target,
becomes that stack axis, each part head-split on its own. ``lm_head.weight``, when a checkpoint has
one, is the tied embedding and is not read. Load with::

    model = otfload.load_params(checkpoint, lambda: Gemma3(config, rngs=nnx.Rngs(0)), tunix_gemma3.TABLE,
                                mesh=mesh)

Shardings come from the module's ``sharding`` metadata (tunix's ``ShardingConfig``: mesh axes
``fsdp`` and ``tp``; the 1-D q/k norms' ``out_sharding=()`` is replicated). ``tests/tunix`` checks
every leaf bitwise against tunix's loader and the logits against transformers.
"""

from __future__ import annotations

from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
T = "layers.{layer}"
TRANSPOSE = Transpose()
# HF [heads * head_dim, embed] → [heads, head_dim, embed] → tunix's [heads, embed, head_dim]
Q_HEADS = (Reshape(("num_attention_heads", -1, "hidden_size")), Transpose((0, 2, 1)))
KV_HEADS = (Reshape(("num_key_value_heads", -1, "hidden_size")), Transpose((0, 2, 1)))
PROJ = f"{L}.self_attn.{{part}}_proj.weight"

TABLE = MappingTable(
    rules=(
        Rule("embedder.input_embedding", "model.embed_tokens.weight"),
        Rule("final_norm.scale", "model.norm.weight"),
        Rule(f"{T}.pre_attention_norm.scale", f"{L}.input_layernorm.weight"),
        Rule(f"{T}.post_attention_norm.scale", f"{L}.post_attention_layernorm.weight"),
        Rule(f"{T}.pre_ffw_norm.scale", f"{L}.pre_feedforward_layernorm.weight"),
        Rule(f"{T}.post_ffw_norm.scale", f"{L}.post_feedforward_layernorm.weight"),
        Rule(f"{T}.attn.q_einsum.w", f"{L}.self_attn.q_proj.weight", Q_HEADS),
        # k then v stacked on the leaf's leading axis
        Rule(f"{T}.attn.kv_einsum.w", PROJ, KV_HEADS, indices={"part": ("k", "v")}),
        # q, k, v stacked; only when q heads == kv heads, so the q-head reshape fits k and v too
        Rule(f"{T}.attn.qkv_einsum.w", PROJ, Q_HEADS, indices={"part": ("q", "k", "v")}),
        Rule(f"{T}.attn.attn_vec_einsum.w", f"{L}.self_attn.o_proj.weight",
             (TRANSPOSE, Reshape(("num_attention_heads", -1, "hidden_size")))),
        Rule(f"{T}.attn._query_norm.scale", f"{L}.self_attn.q_norm.weight"),
        Rule(f"{T}.attn._key_norm.scale", f"{L}.self_attn.k_norm.weight"),
        Rule(f"{T}.mlp.gate_proj.kernel", f"{L}.mlp.gate_proj.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.up_proj.kernel", f"{L}.mlp.up_proj.weight", (TRANSPOSE,)),
        Rule(f"{T}.mlp.down_proj.kernel", f"{L}.mlp.down_proj.weight", (TRANSPOSE,)),
    ),
    ignore=(r".*rotary_emb\.inv_freq", r"lm_head\.weight"),
)
