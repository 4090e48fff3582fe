"""Where a bundled model came from: the HF ``config.json`` and family it was built from.

``from_pretrained`` records them for the model it returns, so ``export_hf(model, out_dir)`` needs no
``config=`` or ``reference=`` for it. The record is weak: it lives as long as the model object.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelOrigin:
    """The HF config a model was built from (a private copy) and its family's name."""

    config: dict[str, Any]
    family: str


_ORIGINS: weakref.WeakKeyDictionary[Any, ModelOrigin] = weakref.WeakKeyDictionary()


def remember_origin(model: Any, config: dict[str, Any], family: str) -> None:
    """Record that ``model`` was built from ``config`` by ``family``."""
    _ORIGINS[model] = ModelOrigin(copy.deepcopy(config), family)


def origin_of(model: Any) -> ModelOrigin | None:
    """The recorded origin of ``model``, or None for a model otfload did not build."""
    try:
        return _ORIGINS.get(model)
    except TypeError:  # not weak-referenceable (a plain pytree of arrays)
        return None
