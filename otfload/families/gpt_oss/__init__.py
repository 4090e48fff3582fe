"""The GPT-OSS family: biased attention with per-head sinks, alternating sliding/full attention and
a sparse MoE on every layer with fused, biased experts (MXFP4 in the published checkpoints).

``config`` parses ``config.json`` into Mixtral's :class:`~otfload.families.mixtral.config.MoeConfig`,
whose decoder (:mod:`otfload.families.mixtral.model`) it builds; ``mapping`` holds the table, the
checks and the LoRA layout. Importing the package registers the family.
"""

from otfload.families.gpt_oss.config import gpt_oss_config
from otfload.families.gpt_oss.mapping import GPT_OSS_LORA, GPT_OSS_TABLE, gpt_oss_checks
from otfload.families.mixtral.model import MoeForCausalLM
from otfload.families.registry import Family, register

GPT_OSS = register(
    Family(
        name="gpt_oss",
        model_types=("gpt_oss",),
        parse_config=gpt_oss_config,
        build=MoeForCausalLM,
        mapping=lambda cfg: GPT_OSS_TABLE,
        checks=gpt_oss_checks,
        lora_layout=GPT_OSS_LORA,
    )
)

__all__ = ["GPT_OSS", "GPT_OSS_TABLE"]
