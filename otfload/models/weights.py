"""Weights held in another form than the one the layer math uses.

A loaded parameter may be a *stored weight*: a pytree node that keeps what was placed on the
devices (packed quantized codes and their scales; a base kernel with its LoRA factors) and
computes the dense kernel only when a layer runs. The models call :func:`materialize` on one
layer's parameters inside the layer loop (``run_layers``), so at most one layer's dense kernels
exist at a time and gradients reach the stored parts.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax


@runtime_checkable
class StoredWeight(Protocol):
    """A pytree node standing for a dense kernel; ``materialize`` computes that kernel."""

    def materialize(self) -> jax.Array: ...


def is_stored(value: Any) -> bool:
    return isinstance(value, StoredWeight)


def materialize(params: Any) -> Any:
    """``params`` with every stored weight replaced by its dense kernel (other leaves unchanged)."""
    return jax.tree.map(lambda w: w.materialize() if is_stored(w) else w, params, is_leaf=is_stored)
