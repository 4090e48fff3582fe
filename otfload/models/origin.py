"""Where a bundled model came from: the HF ``config.json`` and family it was built from.

``from_pretrained`` sets the record on the model it returns (a static attribute,
:data:`ORIGIN_ATTRIBUTE`), so ``export_hf(model, out_dir)`` needs no ``config=`` or ``reference=``
for it. The model owns its record: it travels with ``nnx.split`` / ``nnx.merge`` and ``nnx.clone``,
is not a parameter (``nnx.state`` leaves it out), and compares and hashes by value, like the model's
other static attributes (its config): a program compiled against the abstract model ``plan_model``
gives runs with the loaded one (``otfload lm-eval``, ``otfload.training``). A pytree of arrays
carries none.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

# The attribute of a bundled model holding its ModelOrigin.
ORIGIN_ATTRIBUTE = "otfload_origin"


@dataclass(frozen=True)
class ModelOrigin:
    """The HF config a model was built from (a private copy) and its family's name; equal to another
    with the same config and family, and hashed by them (the config as canonical JSON)."""

    config: dict[str, Any]
    family: str
    _key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", json.dumps([self.family, self.config], sort_keys=True, default=repr))

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"ModelOrigin(family={self.family!r}, model_type={self.config.get('model_type')!r})"


def remember_origin(model: Any, config: dict[str, Any], family: str) -> None:
    """Record on ``model`` that it was built from ``config`` by ``family``."""
    setattr(model, ORIGIN_ATTRIBUTE, ModelOrigin(copy.deepcopy(config), family))


def origin_of(model: Any) -> ModelOrigin | None:
    """The origin ``model`` carries, or None for a model otfload did not build."""
    origin = getattr(model, ORIGIN_ATTRIBUTE, None)
    return origin if isinstance(origin, ModelOrigin) else None
