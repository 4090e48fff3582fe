"""The Qwen3.5 family: the text models (``qwen3_5_text``, ``qwen3_5_moe_text``) and the text model of
the multimodal ``qwen3_5`` / ``qwen3_5_moe`` checkpoints (``Qwen3_5(Moe)ForConditionalGeneration``;
:mod:`otfload.families.multimodal`): Gated DeltaNet and gated attention layers, dense or MoE.

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`'
blocks, ``mapping`` holds the tables and checks; importing the package registers the families.
"""

from otfload.families.multimodal import LANGUAGE_MODEL_PREFIXES, MODULE_PREFIXES, text_model_family
from otfload.families.qwen3_5.config import Qwen35Config, experts_layout
from otfload.families.qwen3_5.mapping import qwen3_5_checks, qwen3_5_table
from otfload.families.qwen3_5.model import Qwen35ForCausalLM
from otfload.families.registry import Family, register

QWEN3_5 = register(
    Family(
        name="qwen3_5",
        model_types=("qwen3_5_text", "qwen3_5_moe_text"),
        parse_config=Qwen35Config.from_hf,
        build=Qwen35ForCausalLM,
        mapping=qwen3_5_table,
        checks=qwen3_5_checks,
        layout=experts_layout,
    )
)

# The releases (and transformers' save_pretrained) keep the text model under model.language_model.:
# that layout first, so export writes it.
RELEASED = (MODULE_PREFIXES, LANGUAGE_MODEL_PREFIXES)
QWEN3_5_MULTIMODAL = register(
    text_model_family("qwen3_5 (text model of a multimodal checkpoint)", ("qwen3_5",), QWEN3_5, "qwen3_5_text",
                      RELEASED)
)
QWEN3_5_MOE_MULTIMODAL = register(
    text_model_family("qwen3_5_moe (text model of a multimodal checkpoint)", ("qwen3_5_moe",), QWEN3_5,
                      "qwen3_5_moe_text", RELEASED)
)

__all__ = ["QWEN3_5", "QWEN3_5_MOE_MULTIMODAL", "QWEN3_5_MULTIMODAL", "Qwen35Config", "Qwen35ForCausalLM"]
