"""The Llama 4 family: the text model (``llama4_text``) and the text model of the multimodal
``llama4`` checkpoints (``Llama4ForConditionalGeneration``; :mod:`otfload.families.multimodal`).

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`'
blocks, ``mapping`` holds the table and checks; importing the package registers both families.
"""

from otfload.families.llama4.config import Llama4Config
from otfload.families.llama4.mapping import LLAMA4_TABLE, llama4_checks
from otfload.families.llama4.model import Llama4ForCausalLM
from otfload.families.multimodal import text_model_family
from otfload.families.registry import Family, register

LLAMA4 = register(
    Family(
        name="llama4",
        model_types=("llama4_text",),
        parse_config=Llama4Config.from_hf,
        build=Llama4ForCausalLM,
        mapping=lambda cfg: LLAMA4_TABLE,
        checks=llama4_checks,
    )
)

# The Hub's releases (and transformers' save_pretrained) keep the text model under language_model.
LLAMA4_MULTIMODAL = register(
    text_model_family("llama4 (text model of a multimodal checkpoint)", ("llama4",), LLAMA4, "llama4_text")
)

__all__ = ["LLAMA4", "LLAMA4_MULTIMODAL", "LLAMA4_TABLE", "Llama4Config", "Llama4ForCausalLM"]
