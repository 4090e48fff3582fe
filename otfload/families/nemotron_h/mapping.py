"""Nemotron-H's mapping table and checks.

The checkpoint keeps the model under ``backbone.`` (the releases and transformers' ``save_pretrained``
alike: transformers renames it ``model.`` on load only), each layer a ``norm`` and a ``mixer``. The
four block kinds are groups (``mamba_layers``, ``attention_layers``, ``mlp_layers``, ``moe_layers``),
each reading its HF layers through the config's list of them, so the groups interleave as
``layers_block_type`` says. Kernels keep HF's ``[out, in]`` orientation: the Mamba-2 ``in_proj``
(gate, conv channels and time steps fused) and the depthwise ``conv1d`` are read as stored; the
attention's q/k/v/o are split by heads (:mod:`otfload.families.gqa_rules`). The MoE blocks read
their experts per expert (``mixer.experts.{expert}.up_proj``/``down_proj``, as transformers saves
them), the router ``gate.weight`` with its ``e_score_correction_bias``, the shared experts and, with
a ``moe_latent_size``, ``fc1_latent_proj``/``fc2_latent_proj``. The
multi-token-prediction layers (``mtp.*``) match no rule and are never read. LoRA adapters name the
modules as transformers 5 runs them (:data:`NEMOTRON_H_LORA`): under ``model.``, the experts' fused
``up_proj``/``down_proj`` parameters."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.gqa_rules import gqa_rules
from otfload.families.lora import ExpertLayout
from otfload.families.nemotron_h.config import NemotronHConfig
from otfload.plan.mapping import MappingTable, Rule

B = "backbone.layers.{layer}"
# leaf under a layer's mixer <- HF key under the layer's mixer (biases: where the config has them)
MAMBA = {"in_proj.kernel": "in_proj.weight", "in_proj.bias": "in_proj.bias", "conv": "conv1d.weight",
         "conv_bias": "conv1d.bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm.scale": "norm.weight",
         "out_proj.kernel": "out_proj.weight", "out_proj.bias": "out_proj.bias"}
UP_DOWN = {f"{n}.{leaf}": f"{n}_proj.{hf}" for n in ("up", "down") for leaf, hf in (("kernel", "weight"),
                                                                                      ("bias", "bias"))}
MOE = {"router.kernel": "gate.weight", "router.bias": "gate.e_score_correction_bias",
       **{f"latent_{d}.{leaf}": f"fc{n}_latent_proj.{hf}" for d, n in (("in", 1), ("out", 2))
          for leaf, hf in (("kernel", "weight"), ("bias", "bias"))},
       **{f"experts.{n}.kernel": f"experts.{{expert}}.{n}_proj.weight" for n in ("up", "down")},
       **{f"shared.{leaf}": f"shared_experts.{key}" for leaf, key in UP_DOWN.items()}}
MIXERS = {"mamba_layers": MAMBA, "mlp_layers": UP_DOWN, "moe_layers": MOE}


# transformers 5 renames backbone. to model. on load and fuses each layer's experts.{e}.up_proj/down_proj.
NEMOTRON_H_LORA = ExpertLayout(renames=(("model.", "backbone."),),
                               fused=(("up_proj", ("up_proj",)), ("down_proj", ("down_proj",))))


def _group(group: str) -> functools.partial[Rule]:
    """A rule of ``group``, its HF layers from the config list named ``group``."""
    return functools.partial(Rule, indices={"layer": group})


NEMOTRON_H_TABLE = MappingTable((
    Rule("embed.embedding", "backbone.embeddings.weight"),
    Rule("final_norm.scale", "backbone.norm_f.weight"),
    Rule("lm_head.kernel", "lm_head.weight"),
    *(_group(group)(f"{group}.{{layer}}.norm.scale", f"{B}.norm.weight")
      for group in ("attention_layers", *MIXERS)),
    *gqa_rules("attention_layers.{layer}.mixer", f"{B}.mixer", rule=_group("attention_layers")),
    *(_group(group)(f"{group}.{{layer}}.mixer.{leaf}", f"{B}.mixer.{key}")
      for group, leaves in MIXERS.items() for leaf, key in leaves.items()),
))


def nemotron_h_checks(cfg: NemotronHConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary and width, the attention heads, the Mamba heads, head size and conv taps
    (on each kind's first layer), the expert count and the latent width against the tensors."""
    embed = "backbone.embeddings.weight"
    checks: list[Count | Dim] = [Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
                                 Dim("vocab_size", cfg.vocab_size, embed, 0),
                                 Dim("hidden_size", cfg.hidden_size, embed, 1)]
    if cfg.attention_layers:
        at = f"backbone.layers.{cfg.attention_layers[0]}.mixer"
        d = ("head_dim", cfg.head_dim)
        checks += [Dim("num_attention_heads", cfg.num_attention_heads, f"{at}.q_proj.weight", 0, d),
                   Dim("num_key_value_heads", cfg.num_key_value_heads, f"{at}.k_proj.weight", 0, d)]
    if cfg.mamba_layers:
        at = f"backbone.layers.{cfg.mamba_layers[0]}.mixer"
        checks += [Dim("mamba_num_heads", cfg.mamba_num_heads, f"{at}.A_log", 0),
                   Dim("mamba_head_dim", cfg.mamba_head_dim, f"{at}.norm.weight", 0,
                       ("mamba_num_heads", cfg.mamba_num_heads)),
                   Dim("conv_kernel", cfg.conv_kernel, f"{at}.conv1d.weight", 2)]
    if cfg.moe_layers:
        checks += [Count("n_routed_experts", cfg.num_experts, "expert"),
                   Dim("n_routed_experts", cfg.num_experts, f"{B}.mixer.gate.weight", 0)]
        if cfg.moe_latent_size:
            checks.append(Dim("moe_latent_size", cfg.moe_latent_size, f"{B}.mixer.fc1_latent_proj.weight", 0))
    return tuple(checks)
