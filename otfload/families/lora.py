"""How a family's expert parameters are named by transformers 5 at runtime, where a PEFT LoRA
adapter is trained, against the names the stored checkpoint keeps.

transformers 5 renames some modules and fuses per-expert weights when it loads a checkpoint (its
``conversion_mapping``), so an adapter may name a parameter the checkpoint splits over experts; a
family states its :class:`ExpertLayout` (:attr:`Family.lora_layout
<otfload.families.registry.Family.lora_layout>`) and :mod:`otfload.adapters.merge` maps the
adapter's names through it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertLayout:
    """How a family's transformers-5 module names map to the stored checkpoint's names.

    ``renames`` are (runtime, stored) fragments; ``fused`` maps a runtime 3-D expert parameter to the
    stored per-expert modules it concatenates along its output axis; ``transposed``: runtime 3-D expert
    parameters are ``[E, in, out]`` (``is_transposed`` in transformers' experts implementation).
    The default (nothing renamed, fused or transposed) is a family without such experts.
    """

    renames: tuple[tuple[str, str], ...] = ()
    fused: tuple[tuple[str, tuple[str, ...]], ...] = ()
    transposed: bool = False


# transformers' Qwen2-MoE pattern (Qwen3-MoE, DeepSeek): per-expert gate_proj|up_proj fused into gate_up_proj.
QWEN2_MOE = ExpertLayout(fused=(("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))))
