"""The Gemma family: Gemma 2 and Gemma 3 text models (``gemma2``, ``gemma3_text``), and the text
model of multimodal Gemma 3 checkpoints (``gemma3``, :mod:`otfload.families.multimodal`).

``config`` parses ``config.json``, ``model`` is the NNX decoder (Llama's attention and MLP
parameters with Gemma's norms, soft-capping and layer pattern), ``mapping`` the table and checks;
importing the package registers both families.
"""

from otfload.families.gemma.config import GemmaConfig
from otfload.families.gemma.mapping import GEMMA_TABLE, gemma_checks
from otfload.families.gemma.model import GemmaForCausalLM
from otfload.families.multimodal import text_model_family
from otfload.families.registry import Family, register

GEMMA = register(
    Family(
        name="gemma",
        model_types=("gemma2", "gemma3_text"),
        parse_config=GemmaConfig.from_hf,
        build=GemmaForCausalLM,
        mapping=lambda cfg: GEMMA_TABLE,
        checks=gemma_checks,
    )
)

GEMMA3_MULTIMODAL = register(
    text_model_family("gemma3 (text model of a multimodal checkpoint)", ("gemma3",), GEMMA, "gemma3_text")
)

__all__ = ["GEMMA", "GEMMA3_MULTIMODAL", "GEMMA_TABLE", "GemmaConfig", "GemmaForCausalLM"]
