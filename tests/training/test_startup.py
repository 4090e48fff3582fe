"""otfload.training's pieces: the abstract model and optimizer carry the shardings the load and
optax give (so a step compiled for them takes the real ones), and ``load_while_compiling`` runs
the compile callback beside the load, under the mesh, from one plan, and raises what it raised."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import otfload
import otfload.api
from otfload.training import abstract_model, abstract_optimizer, load_while_compiling, place_like

TX = optax.adamw(1e-3)


def _leaves(module) -> dict:
    return {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(module))}


def test_abstract_model_and_optimizer_match_the_real_ones(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    abstract = abstract_model(path, mesh=mesh_2x4, dtype=jnp.float32)
    model = otfload.from_pretrained(path, mesh=mesh_2x4, dtype=jnp.float32)
    shapes, real = _leaves(abstract), _leaves(model)
    assert shapes.keys() == real.keys()
    for key, shape in shapes.items():
        assert isinstance(shape, jax.ShapeDtypeStruct)
        assert (shape.shape, shape.dtype, shape.sharding) == (real[key].shape, real[key].dtype, real[key].sharding)

    opt_shape = abstract_optimizer(abstract, TX, mesh_2x4)
    optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)
    shapes = _leaves(opt_shape)
    moments = [key for key in shapes if "mu" in key or "nu" in key]
    assert len(moments) == 2 * len(real)
    for key in moments:  # Adam's moments: sharded like their parameter
        param = real[key[key.index("mu" if "mu" in key else "nu") + 1:]]
        assert shapes[key].sharding == param.sharding and shapes[key].shape == param.shape
    counts = [key for key in shapes if key not in moments]
    assert counts and all(shapes[key].sharding.spec == jax.sharding.PartitionSpec() for key in counts)
    assert any(_leaves(optimizer)[key].sharding != shapes[key].sharding for key in counts)  # optax: one device
    place_like(optimizer, opt_shape)
    for key, value in _leaves(optimizer).items():
        assert (value.shape, value.dtype, value.sharding) == (shapes[key].shape, shapes[key].dtype,
                                                              shapes[key].sharding), key


def test_load_while_compiling_runs_the_callback_under_the_mesh(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    seen = {}

    def compile_(abstract):
        seen["mesh"] = dict(jax.sharding.get_abstract_mesh().shape)
        seen["embedding"] = abstract.embed.embedding.get_value()
        return "compiled"

    startup = load_while_compiling(path, compile_, mesh=mesh_2x4, dtype=jnp.float32)
    assert startup.compiled == "compiled" and seen["mesh"] == {"fsdp": 2, "tp": 4}
    assert seen["embedding"].sharding == startup.model.embed.embedding[...].sharding
    times = startup.times
    assert 0 < times.planned <= min(times.loaded, times.compiled) and times.ready == max(times.loaded, times.compiled)


def test_load_while_compiling_raises_the_compile_error(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")

    def broken(abstract):
        raise ValueError("no such step")

    with pytest.raises(ValueError, match="no such step"):
        load_while_compiling(path, broken, mesh=mesh_2x4)


def test_load_while_compiling_plans_once_and_compiles_against_its_own_copy(tiny_checkpoints, mesh_2x4, monkeypatch):
    path, _ = tiny_checkpoints("llama")
    plans, seen = [], {}
    real_plan = otfload.api._plan_model

    def counted(*args, **kwargs):
        plans.append(args[0])
        return real_plan(*args, **kwargs)

    monkeypatch.setattr(otfload.api, "_plan_model", counted)
    startup = load_while_compiling(path, lambda abstract: seen.setdefault("abstract", abstract), mesh=mesh_2x4)
    assert plans == [path]  # the compile's shapes and the load's reads come from one plan
    assert isinstance(seen["abstract"].embed.embedding.get_value(), jax.ShapeDtypeStruct)  # not filled by the load
    assert isinstance(startup.model.embed.embedding.get_value(), jax.Array)
