"""abstract_module: the abstract model nnx.eval_shape gives, without the tracer-origin walk that
makes tracing a model's initialisation quadratic on JAX ≤ 0.10, the patch undone however it ends;
load_params takes the factory itself."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax._src.interpreters import partial_eval

import otfload
from otfload.plan import eval_shape
from otfload.plan.abstract import abstract_target
from tests.plan.test_abstract_targets import PROJECTION_TABLE, Projection


class Drawn(nnx.Module):
    """Parameters drawn from an nnx.Rngs stream (each draw assigns the stream's counter), with
    logical axis names in metadata."""

    def __init__(self, layers: int, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.kernels = nnx.List([
            nnx.Param(init(rngs.params(), (16, 8), jnp.bfloat16), logical_axes=("embed", "mlp")) for _ in range(layers)
        ])
        self.bias = nnx.Param(jnp.zeros((8,), jnp.float32))


def described(module: nnx.Module) -> list:
    """Every variable's path, type, shape, dtype and metadata."""
    return [
        (path, type(var).__name__, var.get_value().shape, var.get_value().dtype, var.get_metadata())
        for path, var in nnx.to_flat_state(nnx.state(module))
    ]


def origin_patched() -> bool:
    return partial_eval.DynamicJaxprTracer._origin_msg is eval_shape._no_origin


def test_same_abstract_module_as_nnx_eval_shape():
    factory = lambda: Drawn(5, nnx.Rngs(0))  # noqa: E731
    ours = otfload.abstract_module(factory)
    assert described(ours) == described(nnx.eval_shape(factory))
    assert all(isinstance(var.get_value(), jax.ShapeDtypeStruct) for _, var in nnx.to_flat_state(nnx.state(ours)))
    assert not origin_patched()


def test_a_pytree_factory_gives_shape_dtype_structs():
    tree = otfload.abstract_module(lambda: {"w": jnp.ones((3, 4), jnp.bfloat16), "b": jnp.zeros(2)})
    assert tree == {"w": jax.ShapeDtypeStruct((3, 4), jnp.bfloat16), "b": jax.ShapeDtypeStruct((2,), jnp.float32)}


def test_no_origin_walk_while_tracing_and_the_origin_back_after():
    """Inside the trace a tracer's origin is not computed (the walk is what is quadratic); plain
    nnx.eval_shape still computes it, and so does everything after abstract_module returns."""
    seen = {}

    def factory(key: str):
        def build():
            traced = jnp.ones(3) + 1
            seen[key] = traced._origin_msg()
            return Drawn(1, nnx.Rngs(0))
        return build

    otfload.abstract_module(factory("ours"))
    nnx.eval_shape(factory("plain"))
    assert seen["ours"] == ""
    assert "became a tracer" in seen["plain"]
    assert not origin_patched()


def test_the_origin_is_restored_after_an_error_and_nested_calls():
    def failing():
        otfload.abstract_module(lambda: Drawn(1, nnx.Rngs(0)))  # nested: the outer call still holds it
        assert origin_patched()
        raise ValueError("bad config")

    with pytest.raises(ValueError, match="bad config"):
        otfload.abstract_module(failing)
    assert not origin_patched()


def test_concurrent_calls_share_one_patch():
    inside, release = threading.Barrier(3), threading.Event()
    results = []

    def build():
        inside.wait(timeout=10)  # all three traces are running at once
        release.wait(timeout=10)
        return Drawn(2, nnx.Rngs(0))

    threads = [threading.Thread(target=lambda: results.append(otfload.abstract_module(build))) for _ in range(3)]
    for t in threads:
        t.start()
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert len(results) == 3 and not origin_patched()
    assert all(described(r) == described(results[0]) for r in results)


def test_a_module_is_not_taken_for_a_factory(mesh_2x4):
    """nnx modules are often callable (``__call__`` is their forward pass): one is the target."""
    with jax.set_mesh(mesh_2x4):
        abstract = nnx.eval_shape(lambda: Projection(("fsdp", "tp")))
    target = abstract_target(abstract, mesh_2x4)
    assert target.kind == "module"
    assert target.rebuild({k: None for k in target.leaves}) is abstract


def test_load_params_takes_the_factory_and_returns_the_loaded_module(tiny_checkpoints, mesh_2x4):
    """The factory loads exactly what the abstract module does, bit for bit; it runs under the
    mesh given (Flax's eager sharding needs one for out_sharding names)."""
    path, _ = tiny_checkpoints("llama")
    factory = lambda: Projection(("fsdp", "tp"))  # noqa: E731
    from_factory = otfload.load_params(path, factory, PROJECTION_TABLE, mesh=mesh_2x4)
    with jax.set_mesh(mesh_2x4):
        abstract = nnx.eval_shape(factory)
    from_abstract = otfload.load_params(path, abstract, PROJECTION_TABLE, mesh=mesh_2x4)
    assert isinstance(from_factory, Projection)
    for (path_a, a), (path_b, b) in zip(nnx.to_flat_state(nnx.state(from_factory)),
                                        nnx.to_flat_state(nnx.state(from_abstract)), strict=True):
        assert path_a == path_b and a.get_value().sharding == b.get_value().sharding
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    plan = otfload.plan_params(path, factory, PROJECTION_TABLE, mesh=mesh_2x4)
    assert sorted(plan.leaves) == sorted(".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(from_factory)))
