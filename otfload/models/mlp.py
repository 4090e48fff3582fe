"""MLPs in HF's ``[out, in]`` orientation (optional biases): gated ones (``gate``/``up``/``down``) and
the SwiGLU that runs them (Gemma runs the same parameters with GeGLU); ungated ones (``up``/``down``)
with the squared ReLU that runs them (Nemotron-H's ``relu2``)."""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.layers import Dense, ParamOptions, Params, dense


class MlpShape(Protocol):
    """The config fields :class:`Mlp` reads."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def mlp_bias(self) -> bool: ...


class Mlp(nnx.Module):
    """gate/up kernels ``(intermediate, hidden)``, down ``(hidden, intermediate)``."""

    def __init__(self, cfg: MlpShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, m = cfg.hidden_size, cfg.intermediate_size
        bias = (0,) if cfg.mlp_bias else ()
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.gate = Dense((m, h), ("mlp", "embed"), bias_dims=bias, **kw)
        self.up = Dense((m, h), ("mlp", "embed"), bias_dims=bias, **kw)
        self.down = Dense((h, m), ("embed", "mlp"), bias_dims=bias, **kw)


def swiglu(m: Params, h: jax.Array) -> jax.Array:
    """The SwiGLU MLP ``down(silu(gate(h)) * up(h))``."""
    act = jax.nn.silu(dense(m["gate"], h, "bsh,mh->bsm")) * dense(m["up"], h, "bsh,mh->bsm")
    return dense(m["down"], act, "bsm,hm->bsh")


class UpDownMlp(nnx.Module):
    """An ungated MLP: up kernel ``(intermediate, hidden)``, down ``(hidden, intermediate)``."""

    def __init__(self, cfg: MlpShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, m = cfg.hidden_size, cfg.intermediate_size
        bias = (0,) if cfg.mlp_bias else ()
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.up = Dense((m, h), ("mlp", "embed"), bias_dims=bias, **kw)
        self.down = Dense((h, m), ("embed", "mlp"), bias_dims=bias, **kw)


def relu2(x: jax.Array) -> jax.Array:
    """The squared ReLU ``max(x, 0) ** 2``."""
    return jnp.square(jax.nn.relu(x))


def relu2_mlp(m: Params, h: jax.Array) -> jax.Array:
    """The ungated MLP ``down(relu(up(h)) ** 2)``."""
    return dense(m["down"], relu2(dense(m["up"], h, "bsh,mh->bsm")), "bsm,hm->bsh")
