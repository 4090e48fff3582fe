"""The Gemma 4 family: the text model (``gemma4_text``) and the text model of the multimodal
``gemma4`` checkpoints (``Gemma4ForConditionalGeneration``; :mod:`otfload.families.multimodal`).

``config`` parses ``config.json``, ``model`` is the NNX decoder, ``mapping`` the table and checks;
importing the package registers both families.
"""

from otfload.families.gemma4.config import Gemma4Config
from otfload.families.gemma4.mapping import GEMMA4_TABLE, gemma4_checks, gemma4_table
from otfload.families.gemma4.model import Gemma4ForCausalLM
from otfload.families.multimodal import LANGUAGE_MODEL_PREFIXES, MODULE_PREFIXES, text_model_family
from otfload.families.registry import Family, register

GEMMA4 = register(
    Family(
        name="gemma4",
        model_types=("gemma4_text",),
        parse_config=Gemma4Config.from_hf,
        build=Gemma4ForCausalLM,
        mapping=gemma4_table,
        checks=gemma4_checks,
    )
)

# Gemma 4's releases name the text model's tensors as transformers' modules do (model.language_model.),
# so that layout comes first (it is the one export writes).
GEMMA4_MULTIMODAL = register(
    text_model_family("gemma4 (text model of a multimodal checkpoint)", ("gemma4",), GEMMA4, "gemma4_text",
                      layouts=(MODULE_PREFIXES, LANGUAGE_MODEL_PREFIXES))
)

__all__ = ["GEMMA4", "GEMMA4_MULTIMODAL", "GEMMA4_TABLE", "Gemma4Config", "Gemma4ForCausalLM"]
