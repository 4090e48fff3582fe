"""Where a bundled model came from: the HF ``config.json`` and family it was built from.

``from_pretrained`` sets the record on the model it returns (a static attribute,
:data:`ORIGIN_ATTRIBUTE`), so ``export_hf(model, out_dir)`` needs no ``config=`` or ``reference=``
for it. The model owns its record: it travels with ``nnx.split`` / ``nnx.merge`` and ``nnx.clone``,
is not a parameter (``nnx.state`` leaves it out) and hashes by identity (``nnx.jit`` keys on it as on
the model's other static attributes). A pytree of arrays carries none.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# The attribute of a bundled model holding its ModelOrigin.
ORIGIN_ATTRIBUTE = "otfload_origin"


@dataclass(frozen=True, eq=False)
class ModelOrigin:
    """The HF config a model was built from (a private copy) and its family's name; compared and
    hashed by identity (the config is a dict)."""

    config: dict[str, Any]
    family: str

    def __repr__(self) -> str:
        return f"ModelOrigin(family={self.family!r}, model_type={self.config.get('model_type')!r})"


def remember_origin(model: Any, config: dict[str, Any], family: str) -> None:
    """Record on ``model`` that it was built from ``config`` by ``family``."""
    setattr(model, ORIGIN_ATTRIBUTE, ModelOrigin(copy.deepcopy(config), family))


def origin_of(model: Any) -> ModelOrigin | None:
    """The origin ``model`` carries, or None for a model otfload did not build."""
    origin = getattr(model, ORIGIN_ATTRIBUTE, None)
    return origin if isinstance(origin, ModelOrigin) else None
