"""The text model of a multimodal checkpoint, loaded with its text family's model and table.

Multimodal wrappers (Gemma 3's ``Gemma3ForConditionalGeneration``, Kimi-K2.5's
``KimiK25ForConditionalGeneration``) keep the language model's config under ``text_config`` and its
tensors under a prefix: ``language_model.model.`` and ``language_model.lm_head.`` as the Hub's
releases (and transformers' ``save_pretrained``) write them, or ``model.language_model.`` and
``lm_head.``, the names of transformers' modules in memory, which some re-saved checkpoints carry.
:func:`text_model_family` makes a :class:`Family` from the text family: the config is
``text_config`` (a top-level ``tie_word_embeddings`` wins over the text config's, as transformers
ties by the outer config), the table reads the first layout's keys and falls back to the other's,
and the text family's checks run on the prefixed tensors (of either layout) with their fields named
``text_config.*``. The vision tower and projector match no rule: they are listed as unused tensors
and never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from otfload.config import BOOL, Count, Dim, Fields
from otfload.config.fields import OBJECT
from otfload.errors import ConfigError
from otfload.families.registry import Family
from otfload.plan.mapping import MappingTable

TEXT_CONFIG = "text_config"
# Where the Hub's releases keep a multimodal model's language model, then transformers' module names.
LANGUAGE_MODEL_PREFIXES = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
MODULE_PREFIXES = {"model.": "model.language_model.", "lm_head.": "lm_head."}
LAYOUTS = (LANGUAGE_MODEL_PREFIXES, MODULE_PREFIXES)


def text_config(hf: Mapping[str, Any], model_type: str) -> dict[str, Any]:
    """``text_config`` of ``hf`` as a text model's ``config.json`` of ``model_type``."""
    f = Fields(hf)
    text = dict(OBJECT.check(TEXT_CONFIG, f.data.get(TEXT_CONFIG)))
    tied = f.get("tie_word_embeddings", BOOL, None)
    if tied is not None:
        text["tie_word_embeddings"] = tied
    return {**text, "model_type": model_type}


def _prefixed(check: Count | Dim, layouts: Sequence[Mapping[str, str]]) -> list[Count | Dim]:
    """``check`` on the text config's field: a count once (it follows the table's prefixes), a size
    on the tensor of each layout (an absent one is skipped)."""
    if isinstance(check, Count):
        return [dataclasses.replace(check, field=f"{TEXT_CONFIG}.{check.field}")]
    out: list[Count | Dim] = []
    for prefixes in layouts:
        old, new = next((o, n) for o, n in prefixes.items() if check.tensor.startswith(o))
        tensor = new + check.tensor[len(old):]
        out.append(dataclasses.replace(check, field=f"{TEXT_CONFIG}.{check.field}", tensor=tensor))
    return out


def either_layout(table: MappingTable, layouts: Sequence[Mapping[str, str]]) -> MappingTable:
    """``table`` reading the first layout's keys, each falling back to the same key in the others."""
    renamed = [table.with_source_prefixes(prefixes) for prefixes in layouts]
    rules = tuple(
        dataclasses.replace(first, fallbacks=(*(r.source for r in others), *first.fallbacks,
                                              *(f for r in others for f in r.fallbacks)))
        for first, *others in zip(*(t.rules for t in renamed), strict=True)
    )
    return MappingTable(rules, table.ignore)


def text_model_family(name: str, model_types: tuple[str, ...], text: Family[Any], text_model_type: str,
                      layouts: Sequence[Mapping[str, str]] = LAYOUTS) -> Family[Any]:
    """The family of a multimodal checkpoint of ``model_types`` whose language model is a ``text``
    model of ``text_model_type`` stored under the prefixes of one of ``layouts``."""

    def parse(hf: dict[str, Any]) -> Any:
        inner = text_config(hf, text_model_type)  # its own errors name text_config already
        try:
            return text.parse_config(inner)
        except ConfigError as e:
            if e.field.startswith(f"{TEXT_CONFIG}."):
                raise
            raise ConfigError(f"{TEXT_CONFIG}.{e.field}", e.value, e.rule) from None

    def checks(cfg: Any, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
        inner = text_config(config, text_model_type)
        return tuple(p for c in text.checks(cfg, inner) for p in _prefixed(c, layouts))

    return Family(name=name, model_types=model_types, parse_config=parse, build=text.build,
                  mapping=lambda cfg: either_layout(text.mapping(cfg), layouts), checks=checks,
                  layout=text.layout)
