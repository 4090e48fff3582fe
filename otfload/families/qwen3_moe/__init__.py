"""The Qwen3-MoE family: a Qwen3 decoder (q/k RMSNorm) whose feed-forward is a sparse MoE on some
layers and a dense SwiGLU MLP on the others.

``config`` parses ``config.json`` into Mixtral's :class:`~otfload.families.mixtral.config.MoeConfig`,
whose decoder (:mod:`otfload.families.mixtral.model`) it builds; ``mapping`` holds the table (MoE
and dense layers as two groups) and the checks; the LoRA layout is transformers' Qwen2-MoE
pattern (:data:`otfload.families.lora.QWEN2_MOE`). Importing the package registers the family.
"""

from otfload.families.lora import QWEN2_MOE
from otfload.families.mixtral.model import MoeForCausalLM
from otfload.families.qwen3_moe.config import qwen3_moe_config
from otfload.families.qwen3_moe.mapping import QWEN3_MOE_TABLE, qwen3_moe_checks
from otfload.families.registry import Family, register

QWEN3_MOE = register(
    Family(
        name="qwen3_moe",
        model_types=("qwen3_moe",),
        parse_config=qwen3_moe_config,
        build=MoeForCausalLM,
        mapping=lambda cfg: QWEN3_MOE_TABLE,
        checks=qwen3_moe_checks,
        lora_layout=QWEN2_MOE,
    )
)

__all__ = ["QWEN3_MOE", "QWEN3_MOE_TABLE"]
