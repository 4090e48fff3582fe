"""A Linen-style Llama (Llama 2/3, Mistral without sliding window) under a ``params`` collection:
``[in, out]`` kernels and one scanned decoder block, the layer axis leading::

    params.token_embedder.embedding                                  [vocab, embed]
    params.decoder.decoder_norm.scale                                [embed]
    params.decoder.logits_dense.kernel                               [embed, vocab]
    params.decoder.layers.pre_self_attention_layer_norm.scale        [layers, embed]
    params.decoder.layers.post_self_attention_layer_norm.scale       [layers, embed]
    params.decoder.layers.self_attention.query.kernel                [layers, embed, q_heads, head_dim]
    params.decoder.layers.self_attention.key.kernel                  [layers, embed, kv_heads, head_dim]
    params.decoder.layers.self_attention.value.kernel                [layers, embed, kv_heads, head_dim]
    params.decoder.layers.self_attention.out.kernel                  [layers, q_heads, head_dim, embed]
    params.decoder.layers.mlp.wi_0.kernel                            [layers, embed, mlp]   (gate)
    params.decoder.layers.mlp.wi_1.kernel                            [layers, embed, mlp]   (up)
    params.decoder.layers.mlp.wo.kernel                              [layers, mlp, embed]

Every projection is stored ``[in, out]``, the transpose of HF's ``[out, in]``: its rule is
``Transpose()`` (then a ``Reshape`` splitting heads), and the builder copies it tile by tile
(:mod:`otfload.place.transpose`). Unscanned trees (``params.decoder.layers.3.…``) match the same
rules. The table keeps HF's values, for a model applying HF's rotate-half RoPE and its own
``1/sqrt(head_dim)`` (``examples/linen_llama.py``). It is **not** MaxText's tree (no ``params.``
prefix there, ``decoder.layers_0`` unscanned, the layer axis at ``param_scan_axis``, q/k permuted
and the query pre-scaled for Llama 3.1): MaxText runs use :mod:`otfload.maxtext`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule
from otfload.plan.sharding import LogicalRules, logical_to_sharding

L = "model.layers.{layer}"
D = "params.decoder.layers.{layer}"
T = Transpose()

TABLE = MappingTable(
    rules=(
        Rule("params.token_embedder.embedding", "model.embed_tokens.weight"),
        Rule("params.decoder.decoder_norm.scale", "model.norm.weight"),
        Rule("params.decoder.logits_dense.kernel", "lm_head.weight", (T,), fallbacks=("model.embed_tokens.weight",)),
        Rule(f"{D}.pre_self_attention_layer_norm.scale", f"{L}.input_layernorm.weight"),
        Rule(f"{D}.post_self_attention_layer_norm.scale", f"{L}.post_attention_layernorm.weight"),
        Rule(f"{D}.self_attention.query.kernel", f"{L}.self_attn.q_proj.weight",
             (T, Reshape(("hidden_size", "num_attention_heads", -1)))),
        Rule(f"{D}.self_attention.key.kernel", f"{L}.self_attn.k_proj.weight",
             (T, Reshape(("hidden_size", "num_key_value_heads", -1)))),
        Rule(f"{D}.self_attention.value.kernel", f"{L}.self_attn.v_proj.weight",
             (T, Reshape(("hidden_size", "num_key_value_heads", -1)))),
        Rule(f"{D}.self_attention.out.kernel", f"{L}.self_attn.o_proj.weight",
             (T, Reshape(("num_attention_heads", -1, "hidden_size")))),
        Rule(f"{D}.mlp.wi_0.kernel", f"{L}.mlp.gate_proj.weight", (T,)),
        Rule(f"{D}.mlp.wi_1.kernel", f"{L}.mlp.up_proj.weight", (T,)),
        Rule(f"{D}.mlp.wo.kernel", f"{L}.mlp.down_proj.weight", (T,)),
    ),
    ignore=(r".*rotary_emb\.inv_freq",),
)

# Logical axis names (MaxText's spelling) on a (fsdp, tp) mesh: weights fully sharded over fsdp on the model
# dimension, heads and MLP columns over tp; layers and head_dim never split.
LOGICAL_RULES: LogicalRules = (
    ("vocab", "tp"),
    ("embed", "fsdp"),
    ("q_heads", "tp"),
    ("kv_heads", "tp"),
    ("mlp", "tp"),
    ("kv", None),
    ("layers", None),
    ("norm", None),
)


def logical_axes(
    config: Mapping[str, Any], scan_layers: bool = True
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Every leaf's path → (shape, logical axis names) for an HF Llama ``config.json``; unscanned,
    each layer is its own subtree ``params.decoder.layers.{i}``."""
    h, v, i, n = config["hidden_size"], config["vocab_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    block = {
        "pre_self_attention_layer_norm.scale": ((h,), ("norm",)),
        "post_self_attention_layer_norm.scale": ((h,), ("norm",)),
        "self_attention.query.kernel": ((h, heads, hd), ("embed", "q_heads", "kv")),
        "self_attention.key.kernel": ((h, kv, hd), ("embed", "kv_heads", "kv")),
        "self_attention.value.kernel": ((h, kv, hd), ("embed", "kv_heads", "kv")),
        "self_attention.out.kernel": ((heads, hd, h), ("q_heads", "kv", "embed")),
        "mlp.wi_0.kernel": ((h, i), ("embed", "mlp")),
        "mlp.wi_1.kernel": ((h, i), ("embed", "mlp")),
        "mlp.wo.kernel": ((i, h), ("mlp", "embed")),
    }
    out = {
        "params.token_embedder.embedding": ((v, h), ("vocab", "embed")),
        "params.decoder.decoder_norm.scale": ((h,), ("norm",)),
        "params.decoder.logits_dense.kernel": ((h, v), ("embed", "vocab")),
    }
    for name, (shape, axes) in block.items():
        if scan_layers:
            out[f"params.decoder.layers.{name}"] = ((n, *shape), ("layers", *axes))
        else:
            out.update({f"params.decoder.layers.{k}.{name}": (shape, axes) for k in range(n)})
    return out


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b.c": x}`` → ``{"a": {"b": {"c": x}}}``."""
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, name = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, {})
        node[name] = value
    return tree


def abstract_params(
    config: Mapping[str, Any],
    mesh: Mesh | None = None,
    dtype: Any = np.float32,
    rules: LogicalRules = LOGICAL_RULES,
    scan_layers: bool = True,
) -> dict[str, Any]:
    """The Linen-style parameter tree for ``config`` as ``jax.ShapeDtypeStruct`` s, sharded on
    ``mesh`` by ``rules`` (no sharding without a mesh: ``load_params(mesh=...)`` replicates them)."""
    def leaf(shape: tuple[int, ...], axes: tuple[str, ...]) -> jax.ShapeDtypeStruct:
        sharding = None if mesh is None else logical_to_sharding(axes, shape, mesh, rules)
        # the ignore: jax's ShapeDtypeStruct.__init__ is unannotated
        return jax.ShapeDtypeStruct(shape, np.dtype(dtype), sharding=sharding)  # type: ignore[no-untyped-call]

    return nest({path: leaf(shape, axes) for path, (shape, axes) in logical_axes(config, scan_layers).items()})
