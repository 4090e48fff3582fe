"""The Mixtral family: a Mistral decoder whose every feed-forward is a sparse MoE.

``config`` parses ``config.json`` into the :class:`~otfload.families.mixtral.config.MoeConfig` and
``model`` is the sparse-MoE decoder, both shared with Qwen3-MoE and GPT-OSS; ``mapping`` holds the
table, the checks and the LoRA layout of its experts. Importing the package registers the family.
"""

from otfload.families.mixtral.config import mixtral_config
from otfload.families.mixtral.mapping import MIXTRAL_LORA, MIXTRAL_TABLE, mixtral_checks
from otfload.families.mixtral.model import MoeForCausalLM
from otfload.families.registry import Family, register

MIXTRAL = register(
    Family(
        name="mixtral",
        model_types=("mixtral",),
        parse_config=mixtral_config,
        build=MoeForCausalLM,
        mapping=lambda cfg: MIXTRAL_TABLE,
        checks=mixtral_checks,
        lora_layout=MIXTRAL_LORA,
    )
)

__all__ = ["MIXTRAL", "MIXTRAL_TABLE", "MoeForCausalLM"]
