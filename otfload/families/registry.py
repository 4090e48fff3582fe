"""Model families by ``model_type``: config parser, NNX model class and mapping table.

Adding a family is one model module plus one mapping module that calls :func:`register`; the
loader never changes.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from flax import nnx

from otfload.config.tensors import TensorCheck, check_tensors
from otfload.errors import ConfigError, UnsupportedModelError
from otfload.plan.mapping import MappingTable


class FamilyConfig(Protocol):
    """A family's parsed config: typed fields, and their values by name for the mapping's hooks."""

    def to_dict(self) -> dict[str, Any]:
        """Field name → value; the names a mapping table's hooks may refer to."""
        ...


C = TypeVar("C", bound=FamilyConfig)


def no_checks(cfg: object, config: Mapping[str, Any]) -> Sequence[TensorCheck]:
    return ()


@dataclass(frozen=True)
class Family(Generic[C]):
    """What otfload needs to build and fill one model family.

    ``parse_config`` turns ``config.json`` into the model's config (a :class:`FamilyConfig`: a
    ``to_dict()`` whose fields the mapping's hooks may name), raising :class:`~otfload.errors.ConfigError` for any
    field of the wrong type, out of range or inconsistent; ``build(cfg, scan_layers=, dtype=, rngs=)``
    constructs the NNX model; ``mapping(cfg)`` returns the table for that config; ``checks(cfg,
    config)`` lists what the checkpoint's tensors must agree with (layer and expert counts, sizes).
    """

    name: str
    model_types: tuple[str, ...]
    parse_config: Callable[[dict[str, Any]], C]
    build: Callable[..., nnx.Module]
    mapping: Callable[[C], MappingTable]
    checks: Callable[[C, Mapping[str, Any]], Sequence[TensorCheck]] = no_checks

    def config_for(self, config: dict[str, Any], tensors: Mapping[str, object]) -> C:
        """The parsed config, checked against the checkpoint's ``tensors`` (name → info with ``.shape``)
        before anything is built or planned; a violation is a ConfigError."""
        cfg = self.parse_config(config)
        check_tensors(self.checks(cfg, config), self.mapping(cfg), tensors)
        return cfg


_FAMILIES: dict[str, Family[Any]] = {}


def register(family: Family[C]) -> Family[C]:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def family_for(config: Mapping[str, Any]) -> Family[Any]:
    """The registered family of ``config["model_type"]``; a typed error names unknown ones."""
    _load_builtin_families()
    if not isinstance(config, Mapping):
        raise ConfigError("config", config, "must be a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError("model_type", model_type, "is required: a string naming the model family")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(sorted(_FAMILIES))}"
        )
    return _FAMILIES[model_type]


def supported_model_types() -> list[str]:
    _load_builtin_families()
    return sorted(_FAMILIES)


# The built-in family modules; each registers its families when imported. A new family adds its
# module here (an explicit list: what is supported is visible, and nothing is imported by accident).
BUILTIN_FAMILY_MODULES = ("llama", "mixtral", "qwen3_moe", "gemma", "deepseek", "gpt_oss")


def _load_builtin_families() -> None:
    """Import every built-in family module once; each registers its families on import."""
    for name in BUILTIN_FAMILY_MODULES:
        importlib.import_module(f"otfload.families.{name}")
