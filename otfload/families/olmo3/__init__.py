"""The OLMo 3 family (``olmo3``): post-norm decoder layers, q/k norms over whole projections,
sliding and full attention layers.

``config`` parses ``config.json``, ``model`` assembles the decoder from :mod:`otfload.models`'
blocks, ``mapping`` holds the table and checks; importing the package registers the family.
"""

from otfload.families.olmo3.config import Olmo3Config
from otfload.families.olmo3.mapping import OLMO3_TABLE, olmo3_checks
from otfload.families.olmo3.model import Olmo3ForCausalLM
from otfload.families.registry import Family, register

OLMO3 = register(
    Family(
        name="olmo3",
        model_types=("olmo3",),
        parse_config=Olmo3Config.from_hf,
        build=Olmo3ForCausalLM,
        mapping=lambda cfg: OLMO3_TABLE,
        checks=olmo3_checks,
    )
)

__all__ = ["OLMO3", "OLMO3_TABLE", "Olmo3Config", "Olmo3ForCausalLM"]
