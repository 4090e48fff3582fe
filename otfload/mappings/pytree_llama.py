"""An Equinox-style (or any plain-pytree) Llama: modules are pytrees whose attribute names follow HF's
without the ``model.`` prefix, linear weights are ``[out, in]`` (as ``equinox.nn.Linear`` stores
them) and layers are a list::

    embed_tokens.weight                          [vocab, hidden]
    layers.{i}.input_layernorm.weight            [hidden]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight   [out, in]
    layers.{i}.post_attention_layernorm.weight   [hidden]
    layers.{i}.mlp.{gate,up,down}_proj.weight    [out, in]
    norm.weight                                  [hidden]
    lm_head.weight                               [vocab, hidden]

Every leaf is one HF tensor as stored, so no hook runs and every copy is contiguous. A nested dict
with the same keys, or dataclasses registered with ``jax.tree_util.register_dataclass`` (whose
paths are attribute names), match alike (``examples/pytree_llama.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.plan.mapping import MappingTable, Rule

L = "layers.{layer}"
_LAYER = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
          "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")

TABLE = MappingTable(
    rules=(
        Rule("embed_tokens.weight", "model.embed_tokens.weight"),
        Rule("norm.weight", "model.norm.weight"),
        Rule("lm_head.weight", "lm_head.weight", fallbacks=("model.embed_tokens.weight",)),
        *(Rule(f"{L}.{name}.weight", f"model.{L}.{name}.weight") for name in _LAYER),
    ),
    ignore=(r".*rotary_emb\.inv_freq",),
)

# Mesh axes of each [out, in] weight on a (fsdp, tp) mesh: q/k/v/gate/up split their outputs over
# tp, o/down their inputs (Megatron-style), and the model dimension over fsdp. (The ignores: jax's
# PartitionSpec.__init__ is unannotated.)
SPECS: dict[str, PartitionSpec] = {
    "self_attn.q_proj": PartitionSpec("tp", "fsdp"),  # type: ignore[no-untyped-call]
    "self_attn.k_proj": PartitionSpec("tp", "fsdp"),  # type: ignore[no-untyped-call]
    "self_attn.v_proj": PartitionSpec("tp", "fsdp"),  # type: ignore[no-untyped-call]
    "self_attn.o_proj": PartitionSpec("fsdp", "tp"),  # type: ignore[no-untyped-call]
    "mlp.gate_proj": PartitionSpec("tp", "fsdp"),  # type: ignore[no-untyped-call]
    "mlp.up_proj": PartitionSpec("tp", "fsdp"),  # type: ignore[no-untyped-call]
    "mlp.down_proj": PartitionSpec("fsdp", "tp"),  # type: ignore[no-untyped-call]
}


def shapes(config: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every leaf's path → shape for an HF Llama ``config.json``."""
    h, v, i, n = config["hidden_size"], config["vocab_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    hd = config.get("head_dim") or h // heads
    layer = {"input_layernorm": (h,), "post_attention_layernorm": (h,), "self_attn.q_proj": (heads * hd, h),
             "self_attn.k_proj": (kv * hd, h), "self_attn.v_proj": (kv * hd, h), "self_attn.o_proj": (h, heads * hd),
             "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h), "mlp.down_proj": (h, i)}
    out = {"embed_tokens.weight": (v, h), "norm.weight": (h,), "lm_head.weight": (v, h)}
    out.update({f"layers.{k}.{name}.weight": shape for k in range(n) for name, shape in layer.items()})
    return out


def spec_of(path: str, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """The :data:`SPECS` entry of ``path`` where its mesh axes divide ``shape``, else replicated."""
    name = ".".join(path.split(".")[2:-1])
    embedding = path.startswith(("embed_tokens", "lm_head"))
    spec = SPECS.get(name, PartitionSpec("tp", "fsdp") if embedding else None)  # type: ignore[no-untyped-call]
    if spec is None or any(d % mesh.shape[a] for d, a in zip(shape, spec, strict=True)):
        return PartitionSpec()  # type: ignore[no-untyped-call]  # as in SPECS
    return spec


def abstract_params(
    config: Mapping[str, Any], mesh: Mesh | None = None, dtype: Any = np.float32
) -> dict[str, Any]:
    """The tree as nested dicts and a list of layers of ``jax.ShapeDtypeStruct``, sharded on ``mesh``
    by :func:`spec_of` (no sharding without a mesh)."""
    tree: dict[str, Any] = {"layers": [{} for _ in range(config["num_hidden_layers"])]}
    for path, shape in shapes(config).items():
        sharding = None if mesh is None else NamedSharding(mesh, spec_of(path, shape, mesh))
        *parents, name = path.split(".")
        node: Any = tree
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        node[name] = jax.ShapeDtypeStruct(  # type: ignore[no-untyped-call]  # jax: unannotated __init__
            shape, np.dtype(dtype), sharding=sharding
        )
    return tree
