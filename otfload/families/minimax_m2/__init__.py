"""The MiniMax-M2 family (``minimax_m2``): GQA with q/k norms over whole projections and partial
rotary; every layer routed experts by sigmoid score plus correction bias. FP8 block-scaled as
published (``quantization_config``).

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`'
blocks, ``mapping`` holds the table and checks; the LoRA layout is transformers' Mixtral pattern
(:data:`otfload.families.mixtral.mapping.MIXTRAL_LORA`, as transformers maps ``minimax_m2``). Importing the package
registers the family.
"""

from otfload.families.minimax_m2.config import MiniMaxM2Config
from otfload.families.minimax_m2.mapping import MINIMAX_M2_TABLE, minimax_m2_checks
from otfload.families.minimax_m2.model import MiniMaxM2ForCausalLM
from otfload.families.mixtral.mapping import MIXTRAL_LORA
from otfload.families.registry import Family, register

MINIMAX_M2 = register(
    Family(
        name="minimax_m2",
        model_types=("minimax_m2",),
        parse_config=MiniMaxM2Config.from_hf,
        build=MiniMaxM2ForCausalLM,
        mapping=lambda cfg: MINIMAX_M2_TABLE,
        checks=minimax_m2_checks,
        lora_layout=MIXTRAL_LORA,
    )
)

__all__ = ["MINIMAX_M2", "MINIMAX_M2_TABLE", "MiniMaxM2Config", "MiniMaxM2ForCausalLM"]
