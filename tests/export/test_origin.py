"""A bundled model's origin is state the model owns (no side table keyed by models): it travels
with ``nnx.split`` / ``nnx.merge`` and ``nnx.clone``, is not a parameter, and compares by value (two
models built from one config have one graph definition)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from otfload.models.origin import ORIGIN_ATTRIBUTE, origin_of, remember_origin


class Tiny(nnx.Module):
    def __init__(self) -> None:
        self.w = nnx.Param(jnp.arange(3.0))


def test_the_origin_is_the_models_own_state() -> None:
    config = {"model_type": "llama", "hidden_size": 4}
    model = Tiny()
    assert origin_of(model) is None and origin_of({"w": jnp.zeros(3)}) is None
    remember_origin(model, config, "llama")
    config["hidden_size"] = 8  # a private copy: the caller's dict changing later changes nothing
    origin = origin_of(model)
    assert origin is not None and origin.family == "llama" and origin.config["hidden_size"] == 4
    assert origin_of(nnx.merge(*nnx.split(model))) is origin
    assert origin_of(nnx.clone(model)) is origin
    assert [path for path, _ in nnx.to_flat_state(nnx.state(model))] == [("w",)]
    assert float(nnx.jit(lambda m: m.w[...].sum())(model)) == 3.0
    assert origin_of(Tiny()) is None  # another model: no record leaks between objects
    twin = Tiny()  # built from the same config (the abstract model plan_model gives, say): the same metadata
    remember_origin(twin, {"model_type": "llama", "hidden_size": 4}, "llama")
    assert origin_of(twin) == origin and hash(origin_of(twin)) == hash(origin)
    assert nnx.graphdef(twin) == nnx.graphdef(model)  # a program compiled for one runs the other
    other = Tiny()
    remember_origin(other, {"model_type": "llama", "hidden_size": 8}, "llama")
    assert origin_of(other) != origin
    setattr(model, ORIGIN_ATTRIBUTE, "not an origin")
    assert origin_of(model) is None
