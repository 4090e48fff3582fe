"""The Kimi-Linear family (``kimi_linear``): Kimi Delta Attention and MLA layers, dense or DeepSeek
MoE feed-forwards.

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`' blocks,
``mapping`` holds the table and checks; importing the package registers the family. (Kimi-K2 and
K2.5, DeepSeek-V3 models, are :mod:`otfload.families.deepseek`'s.)
"""

from otfload.families.kimi_linear.config import KimiLinearConfig
from otfload.families.kimi_linear.mapping import KIMI_LINEAR_LORA, kimi_linear_checks, kimi_linear_table
from otfload.families.kimi_linear.model import KimiLinearForCausalLM
from otfload.families.registry import Family, register

KIMI_LINEAR = register(
    Family(
        name="kimi_linear",
        model_types=("kimi_linear",),
        parse_config=KimiLinearConfig.from_hf,
        build=KimiLinearForCausalLM,
        mapping=kimi_linear_table,
        checks=kimi_linear_checks,
        lora_layout=KIMI_LINEAR_LORA,
    )
)

__all__ = ["KIMI_LINEAR", "KimiLinearConfig", "KimiLinearForCausalLM"]
