"""Model families by ``model_type``: config parser, NNX model class and mapping table.

Adding a family is one model module plus one mapping module that calls :func:`register`; the
loader never changes.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass

from otfload.errors import UnsupportedModelError
from otfload.plan.mapping import MappingTable


@dataclass(frozen=True)
class Family:
    """What otfload needs to build and fill one model family.

    ``parse_config`` turns ``config.json`` into the model's config object (with a ``to_dict()``
    whose fields the mapping's hooks may name); ``build(cfg, scan_layers=, dtype=, rngs=)``
    constructs the NNX model; ``mapping(cfg)`` returns the table for that config.
    """

    name: str
    model_types: tuple[str, ...]
    parse_config: Callable[[dict], object]
    build: Callable[..., object]
    mapping: Callable[[object], MappingTable]


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_for(config: dict) -> Family:
    """The registered family of ``config["model_type"]``; a typed error names unknown ones."""
    _load_builtin_families()
    model_type = config.get("model_type")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type]


def supported_model_types() -> list[str]:
    _load_builtin_families()
    return sorted(_FAMILIES)


def _load_builtin_families() -> None:
    """Import every module of ``otfload.families`` once; each registers its families on import."""
    import otfload.families as package

    for module in pkgutil.iter_modules(package.__path__):
        if module.name != "registry":
            importlib.import_module(f"otfload.families.{module.name}")
