"""PEFT LoRA adapters merged on the fly: ``from_pretrained(base, adapter="org/my-lora")``.

Each adapted weight becomes an :class:`~otfload.adapters.tensor.AdaptedTensor` in the checkpoint
index (base + LoRA factors, a derived tensor decoded per device box), so planning, stacking and
sharding are those of the base; docs/adapters.md has the math and the supported fields.
"""

from otfload.adapters.config import AdapterConfig, parse_adapter_config
from otfload.adapters.load import open_adapted
from otfload.adapters.merge import Adapter, check_adapted_are_mapped, merge_adapters
from otfload.adapters.source import CombinedSource
from otfload.adapters.tensor import AdaptedTensor, LoraTerm

__all__ = [
    "AdaptedTensor",
    "Adapter",
    "AdapterConfig",
    "CombinedSource",
    "LoraTerm",
    "check_adapted_are_mapped",
    "merge_adapters",
    "open_adapted",
    "parse_adapter_config",
]
