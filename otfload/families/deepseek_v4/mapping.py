"""DeepSeek-V4's mapping table and checks.

Keys as transformers 5.24's ``save_pretrained`` writes them (its conversion mapping turned back:
``model.layers.{i}.attn.wq_a.weight``, ``…ffn.experts.{e}.w1.weight``, ``head.weight``,
``model.hc_head.hc_fn``), each with the published checkpoint's name as fallback (no ``model.``
prefix: ``layers.{i}.…``, ``embed.weight``, ``hc_head_fn``; the attention's ``kv_norm``). Each
layer group reads its HF layers through the config's list of them (``csa_moe_layers``, ...).
Kernels keep HF's ``[out, in]``: ``wq_b`` and the indexer's ``wq_b`` are viewed per head, ``wo_a``
per output group; routed experts are read per expert (``w1`` gate, ``w3`` up, ``w2`` down) and
stacked on the ``experts`` axis. The hash layers' ``tid2eid`` table is read as int32. The
multi-token-prediction module (``mtp.*``) is never read.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.deepseek_v4.config import GROUPS, DeepseekV4Config
from otfload.families.lora import ExpertLayout
from otfload.plan.hooks import Reshape
from otfload.plan.mapping import MappingTable, Rule

L = "layers.{layer}"
# leaf under a layer <- key under the HF layer (and hooks)
LAYER: dict[str, tuple[str, tuple[Any, ...]]] = {
    "attn_hc.fn": ("hc_attn_fn", ()), "attn_hc.base": ("hc_attn_base", ()), "attn_hc.scale": ("hc_attn_scale", ()),
    "ffn_hc.fn": ("hc_ffn_fn", ()), "ffn_hc.base": ("hc_ffn_base", ()), "ffn_hc.scale": ("hc_ffn_scale", ()),
    "input_norm.scale": ("attn_norm.weight", ()), "post_attn_norm.scale": ("ffn_norm.weight", ()),
    "attn.q_a.kernel": ("attn.wq_a.weight", ()), "attn.q_a_norm.scale": ("attn.q_norm.weight", ()),
    "attn.q_b.kernel": ("attn.wq_b.weight", (Reshape(("num_attention_heads", "head_dim", "q_lora_rank")),)),
    "attn.kv.kernel": ("attn.wkv.weight", ()), "attn.kv_norm.scale": ("attn.norm.weight", ()),
    "attn.o_a.kernel": ("attn.wo_a.weight", (Reshape(("o_groups", "o_lora_rank", -1)),)),
    "attn.o_b.kernel": ("attn.wo_b.weight", ()), "attn.sinks": ("attn.attn_sink", ()),
    **{f"attn.{c}.{leaf}": (f"attn.{c}.{key}", ()) for c in ("compressor", "indexer.compressor")
       for leaf, key in (("kv.kernel", "wkv.weight"), ("gate.kernel", "wgate.weight"), ("ape", "ape"),
                         ("norm.scale", "norm.weight"))},
    "attn.indexer.q_b.kernel": ("attn.indexer.wq_b.weight",
                                (Reshape(("index_n_heads", "index_head_dim", "q_lora_rank")),)),
    "attn.indexer.weights_proj.kernel": ("attn.indexer.weights_proj.weight", ()),
    "moe.router.kernel": ("ffn.gate.weight", ()), "moe.router.bias": ("ffn.gate.bias", ()),
    "moe.router.tid2eid": ("ffn.gate.tid2eid", ()),
    **{f"moe.{where}.{name}.kernel": (f"ffn.{key}.{w}.weight", ())
       for where, key in (("experts", "experts.{expert}"), ("shared", "shared_experts"))
       for name, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))},
}
TOP = {"embed.embedding": ("model.embed_tokens.weight", "embed.weight"),
       "final_norm.scale": ("model.norm.weight", "norm.weight"),
       "lm_head.kernel": ("head.weight", "lm_head.weight"),
       **{f"hc_head.{leaf}": (f"model.hc_head.hc_{leaf}", f"hc_head_{leaf}") for leaf in ("fn", "base", "scale")}}


# The attention's key-value norm: ``attn.kv_norm`` in the release, ``attn.norm`` as transformers'
# reverse renaming (``kv_norm`` <- ``norm``, meant for the compressors' norms) writes it back.
RELEASE = {"attn.kv_norm.scale": "attn.kv_norm.weight"}


def _layer_rules(group: str) -> list[Rule]:
    rule = functools.partial(Rule, indices={"layer": group})
    return [rule(f"{group}.{{layer}}.{leaf}", f"model.{L}.{key}", hooks,
                 fallbacks=(f"{L}.{RELEASE.get(leaf, key)}", f"{L}.{key}", f"model.{L}.{RELEASE.get(leaf, key)}"))
            for leaf, (key, hooks) in LAYER.items()]


DEEPSEEK_V4_TABLE = MappingTable(
    (*(Rule(leaf, key, fallbacks=(other,)) for leaf, (key, other) in TOP.items()),
     *(r for group in GROUPS for r in _layer_rules(group))),
    ignore=(r"(model\.)?mtp\..*",),
)


# PEFT LoRA adapters name transformers 5.24's runtime modules: ``self_attn.q_a_proj`` for the stored
# ``attn.wq_a`` (the main attention's projections and the shared expert's), ``mlp.experts.gate_up_proj``
# for each expert's ``ffn.experts.{e}.w1`` and ``w3`` stacked; in the release's names, without ``model.``.
# The compressors' and indexer's are not mapped.
ATTENTION_LORA = {"q_a_proj": "wq_a", "q_b_proj": "wq_b", "kv_proj": "wkv", "o_a_proj": "wo_a", "o_b_proj": "wo_b"}
DEEPSEEK_V4_LORA = ExpertLayout(
    renames=(*((f".self_attn.{r}.", f".attn.{s}.") for r, s in ATTENTION_LORA.items()),
             *((f".mlp.shared_experts.{r}.", f".ffn.shared_experts.{s}.")
               for r, s in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))),
             (".mlp.experts", ".ffn.experts"), ("model.layers.", "layers.")),
    fused=(("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))),
)


def deepseek_v4_checks(cfg: DeepseekV4Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer and expert counts, vocabulary, width, the query heads and the router's rows against the
    tensors, under either naming (a check whose tensor is absent is skipped)."""
    dims: list[Count | Dim] = [Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
                               Count("n_routed_experts", cfg.num_experts, "expert")]
    for embed, layer in (("model.embed_tokens.weight", f"model.{L}"), ("embed.weight", L)):
        dims += [Dim("vocab_size", cfg.vocab_size, embed, 0), Dim("hidden_size", cfg.hidden_size, embed, 1),
                 Dim("num_attention_heads", cfg.num_attention_heads, f"{layer}.attn.wq_b.weight", 0,
                     ("head_dim", cfg.head_dim)),
                 Dim("n_routed_experts", cfg.num_experts, f"{layer}.ffn.gate.weight", 0)]
    return tuple(dims)
