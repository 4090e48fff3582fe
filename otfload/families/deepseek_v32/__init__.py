"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): DeepSeek-V3's MLA decoder
(:class:`~otfload.models.mla_decoder.MlaForCausalLM`) with DeepSeek Sparse Attention's lightning
indexer on every layer (:mod:`otfload.models.sparse_indexer`), and the MLA families' mapping table
(:mod:`otfload.families.mla`).

The two differ only in their config: defaults, and the indexer's RoPE layout
(:mod:`otfload.families.deepseek_v32.config`). Importing the package registers both families.
"""

import dataclasses

from otfload.families.deepseek_v32.config import dsa_config
from otfload.families.lora import QWEN2_MOE
from otfload.families.mla import MLA_TABLE, mla_checks
from otfload.families.registry import Family, register
from otfload.models.mla_decoder import MlaForCausalLM

DEEPSEEK_V32 = register(
    Family(
        name="deepseek_v32",
        model_types=("deepseek_v32",),
        parse_config=dsa_config,
        build=MlaForCausalLM,
        mapping=lambda cfg: MLA_TABLE,
        checks=mla_checks,
        lora_layout=QWEN2_MOE,
    )
)

GLM5 = register(dataclasses.replace(DEEPSEEK_V32, name="glm_moe_dsa (GLM-5)", model_types=("glm_moe_dsa",)))

__all__ = ["DEEPSEEK_V32", "GLM5", "dsa_config"]
