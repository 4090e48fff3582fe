"""PEFT LoRA adapters merged on the fly: ``from_pretrained(base, adapter="org/my-lora")``, or kept
as separate factors (``merge_adapter=False``, :mod:`otfload.adapters.factored`). A layer on the opened
base checkpoint: :func:`~otfload.adapters.load.add_adapters`, applied by the front door
(:mod:`otfload.opening`).

Each adapted weight becomes an :class:`~otfload.adapters.tensor.AdaptedTensor` in the checkpoint
index (base + LoRA factors, a derived tensor decoded per device box), so planning, stacking and
sharding are those of the base; docs/adapters.md has the math and the supported fields.
"""

from otfload.adapters.config import AdapterConfig, parse_adapter_config
from otfload.adapters.load import add_adapters
from otfload.adapters.merge import Adapter, check_adapted_are_mapped, merge_adapters
from otfload.adapters.source import CombinedSource
from otfload.adapters.tensor import AdaptedTensor, LoraTerm
from otfload.adapters.weight import KernelLayout, LoraWeight, lora_factors, with_lora_factors

__all__ = [
    "AdaptedTensor",
    "Adapter",
    "AdapterConfig",
    "CombinedSource",
    "KernelLayout",
    "LoraTerm",
    "LoraWeight",
    "add_adapters",
    "check_adapted_are_mapped",
    "lora_factors",
    "merge_adapters",
    "parse_adapter_config",
    "with_lora_factors",
]
