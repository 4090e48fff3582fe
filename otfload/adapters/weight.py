"""A kernel with its LoRA factors kept apart: :class:`LoraWeight`, a stored weight.

``merge_adapter=False`` places each adapted kernel as a :class:`LoraWeight` (a pytree node with the
:class:`~otfload.models.weights.StoredWeight` protocol): the base kernel as loaded, and the factors
laid out along the kernel's own dims, so they shard with the base's logical axes:

- ``b`` ``[*stack, *out_dims, r]``: ``B``'s rows reshaped like the kernel's output dims;
- ``a`` ``[*stack, r, *in_dims]``: ``A``'s columns reshaped like the kernel's input dims;
- ``scale`` ``[*stack]``: ``s = alpha/r`` (``alpha/√r`` with rsLoRA) of each stacked slice.

``materialize()`` (called one layer at a time inside the models' layer loop) returns
``base + s·(b ⊗_r a)`` computed in float32, permuted to the kernel's dim order
(:class:`KernelLayout`), cast to the base dtype. Gradients reach ``a`` and ``b`` (and ``base``);
``scale`` is a constant (``stop_gradient``), so an optimizer leaves it as it is. Slices of a stacked
leaf that the adapter does not adapt, or adapt with a smaller rank than the others, hold zero
factor rows/columns: their delta is exactly zero and stays so under gradient descent.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class KernelLayout:
    """Which dims of the kernel (without stack dims) come from ``B``'s rows (``out_dims``) and which
    from ``A``'s columns (``in_dims``), each in increasing order."""

    out_dims: tuple[int, ...]
    in_dims: tuple[int, ...]

    @property
    def ndim(self) -> int:
        return len(self.out_dims) + len(self.in_dims)

    def permutation(self) -> tuple[int, ...]:
        """The transpose taking ``[*out_dims, *in_dims]`` to the kernel's dim order."""
        return tuple(int(i) for i in np.argsort((*self.out_dims, *self.in_dims)))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoraWeight:
    """``base`` plus ``scale · B@A`` in the kernel's layout; see the module docstring."""

    base: jax.Array
    a: jax.Array
    b: jax.Array
    scale: jax.Array
    layout: KernelLayout = field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.base.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.base.dtype

    @property
    def rank(self) -> int:
        return int(self.a.shape[self.a.ndim - 1 - len(self.layout.in_dims)])

    def delta(self) -> jax.Array:
        """``scale · B@A`` in float32, shaped like ``base``."""
        stack = self.a.ndim - 1 - len(self.layout.in_dims)
        lead = tuple(self.a.shape[:stack])
        out_shape, in_shape = tuple(self.b.shape[stack:-1]), tuple(self.a.shape[stack + 1 :])
        b = self.b.astype(jnp.float32).reshape(*lead, math.prod(out_shape), self.rank)
        a = self.a.astype(jnp.float32).reshape(*lead, self.rank, math.prod(in_shape))
        delta = jnp.matmul(b, a, precision=jax.lax.Precision.HIGHEST).reshape(*lead, *out_shape, *in_shape)
        scale = jax.lax.stop_gradient(self.scale).astype(jnp.float32)
        delta = delta * scale.reshape(*lead, *(1,) * self.layout.ndim)
        return delta.transpose(*range(stack), *(stack + p for p in self.layout.permutation()))

    def materialize(self) -> jax.Array:
        return (self.base.astype(jnp.float32) + self.delta()).astype(self.base.dtype)


def is_lora(value: Any) -> bool:
    return isinstance(value, LoraWeight)


def lora_factors(tree: Any) -> list[dict[str, jax.Array]]:
    """``[{"a": a, "b": b}, ...]`` of every :class:`LoraWeight` in ``tree`` (an ``nnx.State``, a
    pytree), in tree order: what to differentiate to train the adapter alone."""
    return [{"a": w.a, "b": w.b} for w in jax.tree.leaves(tree, is_leaf=is_lora) if is_lora(w)]


def with_lora_factors(tree: Any, factors: list[dict[str, jax.Array]]) -> Any:
    """``tree`` with its LoRA factors replaced by ``factors`` (as :func:`lora_factors` lists them)::

        graphdef, state = nnx.split(model)
        loss = lambda f: loss_fn(nnx.merge(graphdef, with_lora_factors(state, f)))
        grads = jax.grad(loss)(lora_factors(state))   # no gradient of the base is computed
    """
    it = iter(factors)
    out = jax.tree.map(lambda w: dataclasses.replace(w, **next(it)) if is_lora(w) else w, tree, is_leaf=is_lora)
    if next(it, None) is not None:
        raise ValueError("more factor pairs than LoraWeights in the tree")
    return out


__all__ = ["KernelLayout", "LoraWeight", "is_lora", "lora_factors", "with_lora_factors"]
