"""Model families by ``model_type``: config parser, NNX model class, mapping table, LoRA layout.

Each family is one package under :mod:`otfload.families` (``llama/``, ``gemma/``, ...: its config,
model, mapping table and, for fused experts, LoRA layout) whose ``__init__`` calls :func:`register`.
Every subpackage is imported on first use, so adding a family is adding its package; the loader
and this registry never change. Plain modules beside the packages (this one, ``multimodal``,
``lora``) are what families share.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from flax import nnx

from otfload.config.tensors import TensorCheck, check_tensors
from otfload.errors import ConfigError, UnsupportedModelError
from otfload.families.lora import ExpertLayout
from otfload.plan.mapping import MappingTable


class FamilyConfig(Protocol):
    """A family's parsed config: typed fields, and their values by name for the mapping's hooks."""

    def to_dict(self) -> dict[str, Any]:
        """Field name → value; the names a mapping table's hooks may refer to."""
        ...


C = TypeVar("C", bound=FamilyConfig)


def no_checks(cfg: object, config: Mapping[str, Any]) -> Sequence[TensorCheck]:
    return ()


def same_layout(cfg: Any, names: Collection[str]) -> Any:
    return cfg


@dataclass(frozen=True)
class Family(Generic[C]):
    """What otfload needs to build and fill one model family.

    ``parse_config`` turns ``config.json`` into the model's config (a :class:`FamilyConfig`: a
    ``to_dict()`` whose fields the mapping's hooks may name), raising :class:`~otfload.errors.ConfigError` for any
    field of the wrong type, out of range or inconsistent; ``build(cfg, scan_layers=, dtype=, rngs=)``
    constructs the NNX model; ``mapping(cfg)`` returns the table for that config; ``checks(cfg,
    config)`` lists what the checkpoint's tensors must agree with (layer and expert counts, sizes);
    ``lora_layout`` maps the expert names LoRA adapters use to the checkpoint's
    (:mod:`otfload.families.lora`). ``layout(cfg, tensor names)`` is ``cfg`` with what the checkpoint's
    index decides where one family's releases store a tensor in two ways (Qwen3.5's experts fused or
    per expert); it runs on load and on an export with a reference checkpoint.
    """

    name: str
    model_types: tuple[str, ...]
    parse_config: Callable[[dict[str, Any]], C]
    build: Callable[..., nnx.Module]
    mapping: Callable[[C], MappingTable]
    checks: Callable[[C, Mapping[str, Any]], Sequence[TensorCheck]] = no_checks
    lora_layout: ExpertLayout = ExpertLayout()
    layout: Callable[[C, Collection[str]], C] = same_layout

    def config_for(self, config: dict[str, Any], tensors: Mapping[str, object]) -> C:
        """The parsed config, checked against the checkpoint's ``tensors`` (name → info with ``.shape``)
        before anything is built or planned; a violation is a ConfigError."""
        cfg = self.layout(self.parse_config(config), tensors.keys())
        check_tensors(self.checks(cfg, config), self.mapping(cfg), tensors)
        return cfg


_FAMILIES: dict[str, Family[Any]] = {}


def register(family: Family[C]) -> Family[C]:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def find_family(model_type: str) -> Family[Any] | None:
    """The registered family of ``model_type``, or None when none is."""
    _load_builtin_families()
    return _FAMILIES.get(model_type)


def family_for(config: Mapping[str, Any]) -> Family[Any]:
    """The registered family of ``config["model_type"]``; a typed error names unknown ones."""
    if not isinstance(config, Mapping):
        raise ConfigError("config", config, "must be a JSON object")
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError("model_type", model_type, "is required: a string naming the model family")
    family = find_family(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    return family


def supported_model_types() -> list[str]:
    _load_builtin_families()
    return sorted(_FAMILIES)


@functools.cache
def _load_builtin_families() -> None:
    """Import every family package of :mod:`otfload.families` once (each registers its families on
    import)."""
    package = importlib.import_module("otfload.families")
    for module in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if module.ispkg:
            importlib.import_module(f"{package.__name__}.{module.name}")
