"""The GLM-4.5 / GLM-4.6 family (``glm4_moe``): GQA with biases, optional q/k norms and partial
rotary; dense first layers, then DeepSeek-V3-style routed and shared experts.

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`'
blocks, ``mapping`` holds the table and checks; the LoRA layout is transformers' Qwen2-MoE pattern
(:data:`otfload.families.lora.QWEN2_MOE`, as transformers maps ``glm4_moe``). Importing the package
registers the family.
"""

from otfload.families.glm4_moe.config import Glm4MoeConfig
from otfload.families.glm4_moe.mapping import GLM4_MOE_TABLE, glm4_moe_checks
from otfload.families.glm4_moe.model import Glm4MoeForCausalLM
from otfload.families.lora import QWEN2_MOE
from otfload.families.registry import Family, register

GLM4_MOE = register(
    Family(
        name="glm4_moe",
        model_types=("glm4_moe",),
        parse_config=Glm4MoeConfig.from_hf,
        build=Glm4MoeForCausalLM,
        mapping=lambda cfg: GLM4_MOE_TABLE,
        checks=glm4_moe_checks,
        lora_layout=QWEN2_MOE,
    )
)

__all__ = ["GLM4_MOE", "GLM4_MOE_TABLE", "Glm4MoeConfig", "Glm4MoeForCausalLM"]
