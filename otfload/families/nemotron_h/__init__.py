"""The Nemotron-H family (``nemotron_h``: Nemotron-3, ``NemotronHForCausalLM``): Mamba-2, attention,
MLP and MoE blocks in the pattern ``layers_block_type`` gives, under ``backbone.``.

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`'
blocks, ``mapping`` holds the table, checks and LoRA layout; importing the package registers the
family.
"""

from otfload.families.nemotron_h.config import NemotronHConfig
from otfload.families.nemotron_h.mapping import NEMOTRON_H_LORA, NEMOTRON_H_TABLE, nemotron_h_checks
from otfload.families.nemotron_h.model import NemotronHForCausalLM
from otfload.families.registry import Family, register

NEMOTRON_H = register(
    Family(
        name="nemotron_h",
        model_types=("nemotron_h",),
        parse_config=NemotronHConfig.from_hf,
        build=NemotronHForCausalLM,
        mapping=lambda cfg: NEMOTRON_H_TABLE,
        checks=nemotron_h_checks,
        lora_layout=NEMOTRON_H_LORA,
    )
)

__all__ = ["NEMOTRON_H", "NEMOTRON_H_TABLE", "NemotronHConfig", "NemotronHForCausalLM"]
