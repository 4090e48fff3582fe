"""The DeepSeek family: DeepSeek-V2 and DeepSeek-V3 (multi-head latent attention, dense then routed
MoE layers with shared experts), Kimi-K2 (the V3 architecture under ``kimi_k2``) and the text model
of Kimi-K2.5's multimodal checkpoints (``kimi_k25``, :mod:`otfload.families.multimodal`).

``config`` parses ``config.json``, ``model`` is the NNX decoder, ``mapping`` the table and checks;
the LoRA layout is transformers' Qwen2-MoE pattern (:data:`otfload.families.lora.QWEN2_MOE`).
Importing the package registers the three families.
"""

import dataclasses
from typing import Any

from otfload.families.deepseek.config import DeepseekConfig
from otfload.families.deepseek.mapping import DEEPSEEK_TABLE, deepseek_checks
from otfload.families.deepseek.model import DeepseekForCausalLM
from otfload.families.lora import QWEN2_MOE, ExpertLayout
from otfload.families.multimodal import text_model_family
from otfload.families.registry import Family, register

DEEPSEEK = register(
    Family(
        name="deepseek",
        model_types=("deepseek_v2", "deepseek_v3"),
        parse_config=DeepseekConfig.from_hf,
        build=DeepseekForCausalLM,
        mapping=lambda cfg: DEEPSEEK_TABLE,
        checks=deepseek_checks,
        lora_layout=QWEN2_MOE,
    )
)


def kimi_config(hf: dict[str, Any]) -> DeepseekConfig:
    """A ``kimi_k2`` config parsed as the DeepSeek-V3 config it is."""
    return DeepseekConfig.from_hf({**hf, "model_type": "deepseek_v3"})


# transformers has no kimi_k2 model type, so nothing renames or fuses its experts at load time: an
# adapter names the checkpoint's own per-expert modules.
KIMI_K2 = register(
    dataclasses.replace(DEEPSEEK, name="kimi_k2 (DeepSeek-V3 architecture)", model_types=("kimi_k2",),
                        parse_config=kimi_config, lora_layout=ExpertLayout())
)

KIMI_K25 = register(
    text_model_family("kimi_k25 (text model of a multimodal checkpoint)", ("kimi_k25",), KIMI_K2, "kimi_k2")
)

__all__ = ["DEEPSEEK", "DEEPSEEK_TABLE", "KIMI_K2", "KIMI_K25", "DeepseekConfig", "DeepseekForCausalLM"]
