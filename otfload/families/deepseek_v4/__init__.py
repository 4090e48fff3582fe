"""DeepSeek-V4 (``deepseek_v4``): hyper-connection streams, sliding / compressed sparse / heavily
compressed attention layers and hash- or top-k-routed MoE layers, as transformers 5.24 builds them.

``config`` parses ``config.json`` (refusing, by field, what otfload does not implement), ``model`` is
the NNX decoder, ``mapping`` the table and checks. Importing the package registers the family.
"""

from otfload.families.deepseek_v4.config import DeepseekV4Config, deepseek_v4_config
from otfload.families.deepseek_v4.mapping import DEEPSEEK_V4_LORA, DEEPSEEK_V4_TABLE, deepseek_v4_checks
from otfload.families.deepseek_v4.model import DeepseekV4ForCausalLM
from otfload.families.registry import Family, register

DEEPSEEK_V4 = register(
    Family(
        name="deepseek_v4",
        model_types=("deepseek_v4",),
        parse_config=deepseek_v4_config,
        build=DeepseekV4ForCausalLM,
        mapping=lambda cfg: DEEPSEEK_V4_TABLE,
        checks=deepseek_v4_checks,
        lora_layout=DEEPSEEK_V4_LORA,
    )
)

__all__ = ["DEEPSEEK_V4", "DEEPSEEK_V4_TABLE", "DeepseekV4Config", "DeepseekV4ForCausalLM", "deepseek_v4_config"]
