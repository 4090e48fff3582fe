"""transformers' ``layer_types``: each decoder layer's attention, sliding-window or full.

Gemma 2/3 and GPT-OSS alternate the two; a config lists one type per layer, or the family derives
the list from its own pattern fields (``default``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from otfload.config.fields import Choice, Fields, List, require

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = List(Choice(SLIDING, FULL))


def layer_types(f: Fields, num_hidden_layers: int, default: Callable[[], Sequence[str]]) -> tuple[str, ...]:
    """``layer_types`` of ``f``, or ``default()`` when absent; checked to name one type per layer."""
    types: tuple[str, ...] | None = f.get("layer_types", LAYER_TYPES, None)
    if types is None:
        types = tuple(default())
    require(len(types) == num_hidden_layers, f.name("layer_types"), list(types),
            f"must list one type per layer (num_hidden_layers = {num_hidden_layers})")
    return types
