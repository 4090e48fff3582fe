"""Bring-your-own targets: an abstract nnx.Module, an nnx.State and a pytree load through
load_params and come back in their own kind; shardings come from values, out_sharding names or
logical rules; every bad target is a typed error at plan time (plan_params), before any byte."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import otfload
from otfload.errors import (
    CheckpointMismatchError,
    IndivisibleShardingError,
    MappingError,
    MeshRequiredError,
    UnmappedLeafError,
)
from otfload.families.llama.model import LlamaForCausalLM
from otfload.families.registry import family_for
from otfload.index.checkpoint import open_index
from otfload.plan.abstract import abstract_target
from otfload.sources import open_source
from tests.helpers import hf_tensors, jax_logits, max_rel_diff, token_ids, torch_logits

Q = "model.layers.{layer}.self_attn.q_proj.weight"


def llama_parts(path):
    """The family's config dict (its table's hooks name its fields), table and an abstract otfload
    Llama (logical_axes metadata, no mesh)."""
    with contextlib.closing(open_source(path)) as source:  # headers and config only
        index = open_index(source)
    family = family_for(index.config)
    cfg = family.config_for(index.config, index.tensors)
    abstract = nnx.eval_shape(lambda: LlamaForCausalLM(cfg, scan_layers=True, dtype=np.float32, rngs=nnx.Rngs(0)))
    return cfg.to_dict(), family.mapping(cfg), abstract


class Projection(nnx.Module):
    """A user module: one [in, out] kernel per layer, sharding names in Flax's out_sharding."""

    def __init__(self, names, layers=3):
        self.layers = nnx.List([nnx.Param(jnp.zeros((64, 64)), out_sharding=names) for _ in range(layers)])
        self.embed = nnx.Param(jnp.zeros((256, 64)), out_sharding=(names[1], None))


PROJECTION_TABLE = [
    otfload.Rule("layers.{layer}", Q, (otfload.Transpose(),)),
    otfload.Rule("embed", "model.embed_tokens.weight"),
]


class FusedKV(nnx.Module):
    """A fused k/v weight per layer (``[2, kv_out, in]``, two differently named HF tensors) and a 1-D
    norm whose ``out_sharding=()`` says replicated (as tunix's Gemma3 norms do)."""

    def __init__(self, kv_shape):
        self.kv = nnx.List([nnx.Param(jnp.zeros((2, *kv_shape)), out_sharding=(None, "tp", None)) for _ in range(3)])
        self.norm = nnx.Param(jnp.zeros((64,)), out_sharding=())


FUSED_TABLE = [
    otfload.Rule("kv.{layer}", "model.layers.{layer}.self_attn.{part}_proj.weight", indices={"part": ("k", "v")}),
    otfload.Rule("norm", "model.norm.weight"),
]


def test_named_indices_stack_differently_named_tensors_and_no_names_replicate(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    hf = hf_tensors(path)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: FusedKV(hf["model.layers.0.self_attn.k_proj.weight"].shape))
    plan = otfload.plan_params(path, abstract, FUSED_TABLE, mesh=mesh_2x4)
    assert [info.name for info in plan.leaves["kv.1"].sources] == [
        "model.layers.1.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
    model = otfload.load_params(path, abstract, FUSED_TABLE, mesh=mesh_2x4)
    for layer in range(3):
        kv = model.kv[layer][...]
        expected = np.stack([hf[f"model.layers.{layer}.self_attn.{part}_proj.weight"] for part in "kv"])
        np.testing.assert_array_equal(np.asarray(kv), expected)
        assert kv.sharding.spec == P(None, "tp", None)
    norm = model.norm[...]
    assert norm.sharding.spec == P() and norm.sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(norm), hf["model.norm.weight"])


def test_abstract_module_comes_back_loaded_and_matches_transformers(tiny_checkpoints, mesh_2x4):
    path, torch_model = tiny_checkpoints("llama")
    config, table, abstract = llama_parts(path)
    model = otfload.load_params(path, abstract, table, config=config, mesh=mesh_2x4)
    assert model is abstract and isinstance(model.layers.attn.q.kernel[...], jax.Array)
    reference = otfload.from_pretrained(path, mesh=mesh_2x4)
    ours, theirs = nnx.state(model, nnx.Param), nnx.state(reference, nnx.Param)
    for (p, a), (_, b) in zip(nnx.to_flat_state(ours), nnx.to_flat_state(theirs), strict=True):
        assert a[...].sharding == b[...].sharding, p  # logical_axes through DEFAULT_RULES, as from_pretrained
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]))
    ids = token_ids()
    assert max_rel_diff(jax_logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4


def test_state_comes_back_as_a_state_without_value_paths(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    config, table, abstract = llama_parts(path)
    graphdef, state = nnx.split(abstract)
    assert not any(k.endswith("value") for k in abstract_target(state, mesh_2x4).leaves)
    loaded = otfload.load_params(path, state, table, config=config, mesh=mesh_2x4)
    assert isinstance(loaded, nnx.State)
    model = nnx.merge(graphdef, loaded)
    hf = hf_tensors(path)
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), hf["model.embed_tokens.weight"])


def test_flax_out_sharding_on_an_abstract_mesh_needs_and_takes_mesh(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    with jax.set_mesh(mesh_2x4):  # eager sharding: values carry NamedShardings on an AbstractMesh
        abstract = nnx.eval_shape(lambda: Projection(("fsdp", "tp")))
    assert isinstance(abstract.layers[0].get_value().sharding.mesh, jax.sharding.AbstractMesh)
    with pytest.raises(MeshRequiredError, match=r"leaf '(embed|layers\.\d)' is sharded .* on an abstract mesh"):
        otfload.plan_params(path, abstract, PROJECTION_TABLE)
    model = otfload.load_params(path, abstract, PROJECTION_TABLE, mesh=mesh_2x4)
    q = model.layers[2][...]
    assert q.sharding == NamedSharding(mesh_2x4, P("fsdp", "tp"))
    assert {s.data.shape for s in q.addressable_shards} == {(32, 16)}
    np.testing.assert_array_equal(np.asarray(q), hf_tensors(path)["model.layers.2.self_attn.q_proj.weight"].T)


def test_out_sharding_names_without_eager_sharding(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    with nnx.use_eager_sharding(False):
        by_mesh_axes = nnx.eval_shape(lambda: Projection(("tp", "fsdp")))
        by_logical = nnx.eval_shape(lambda: Projection(("embed", "mlp")))
        unknown = nnx.eval_shape(lambda: Projection(("embed", "q_heads")))
    assert by_mesh_axes.layers[0].get_value().sharding is None  # names only: silently replicated before
    plan = otfload.plan_params(path, by_mesh_axes, PROJECTION_TABLE, mesh=mesh_2x4)
    assert plan.leaves["layers.0"].leaf.sharding.spec == P("tp", "fsdp")
    logical = otfload.plan_params(path, by_logical, PROJECTION_TABLE, mesh=mesh_2x4)
    assert logical.leaves["layers.0"].leaf.sharding.spec == P("fsdp", "tp")  # DEFAULT_RULES
    rules = [("embed", "tp"), ("mlp", None)]  # replace the default rules: "mlp" replicated
    custom = otfload.plan_params(path, by_logical, PROJECTION_TABLE, mesh=mesh_2x4, rules=rules)
    assert custom.leaves["layers.0"].leaf.sharding.spec == P("tp")
    with pytest.raises(MappingError, match="q_heads"):
        otfload.plan_params(path, unknown, PROJECTION_TABLE, mesh=mesh_2x4)


def test_indivisible_sharding_is_a_plan_error_naming_leaf_axis_and_sizes(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    tree = {"embed": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(mesh_2x4, P(None, "tp"))),
            "norm": jax.ShapeDtypeStruct((6,), np.float32, sharding=NamedSharding(mesh_2x4, P("tp")))}
    with pytest.raises(IndivisibleShardingError) as e:
        otfload.plan_params(path, tree, {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"})
    err = e.value
    assert (err.leaf, err.axis, err.size, err.mesh_axes, err.mesh_size) == ("norm", 0, 6, ("tp",), 4)
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: Projection((None, ("fsdp", "tp")), layers=1))
        abstract.layers[0] = nnx.Param(jax.ShapeDtypeStruct((64, 12), np.float32), out_sharding=(None, ("fsdp", "tp")))
    with pytest.raises(IndivisibleShardingError, match=r"'layers\.0': dimension 1 of size 12 .*\('fsdp', 'tp'\) of 8"):
        otfload.plan_params(path, abstract, PROJECTION_TABLE, mesh=mesh_2x4)


def test_unmapped_leaves_name_the_nearest_rules_and_join_other_problems(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    s = NamedSharding(mesh_2x4, P())
    tree = {"params": {"embed": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=s),
                       "final_norm": jax.ShapeDtypeStruct((64,), np.float32, sharding=s)}}
    table = [otfload.Rule("embed", "model.embed_tokens.weight"), otfload.Rule("final_norm", "model.norm.weight")]
    with pytest.raises(UnmappedLeafError) as e:
        otfload.plan_params(path, tree, table)
    assert [(p.kind, p.leaf, p.actual) for p in e.value.problems] == [
        ("unmapped", "params.embed", ["embed"]), ("unmapped", "params.final_norm", ["final_norm"])]
    assert "no mapping rule matches leaf 'params.embed'" in str(e.value) and "nearest rules: 'embed'" in str(e.value)
    table = [otfload.Rule("params.embed", "model.embed_tokens.wrong")]
    with pytest.raises(CheckpointMismatchError) as e:
        otfload.load_params(path, tree, table)
    assert {p.kind for p in e.value.problems} == {"unmapped", "missing"}


def test_leaves_without_sharding_need_a_mesh_and_are_replicated_on_it(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    tree = {"emb": jax.ShapeDtypeStruct((256, 64), np.float32)}
    with pytest.raises(MeshRequiredError, match="'emb' has no sharding"):
        otfload.plan_params(path, tree, {"emb": "model.embed_tokens.weight"})
    with jax.set_mesh(mesh_2x4):  # the mesh of an enclosing jax.set_mesh counts as mesh=
        loaded = otfload.load_params(path, tree, {"emb": "model.embed_tokens.weight"})
    assert loaded["emb"].sharding == NamedSharding(mesh_2x4, P())


def test_plan_params_describes_the_plan_from_headers(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    with jax.set_mesh(mesh_2x4):
        abstract = nnx.eval_shape(lambda: Projection(("fsdp", "tp")))
    plan = otfload.plan_params(path, abstract, PROJECTION_TABLE, mesh=mesh_2x4)
    assert sorted(plan.leaves) == ["embed", "layers.0", "layers.1", "layers.2"]
    described = plan.leaves["layers.1"].describe()
    assert described["hf_keys"] == ["model.layers.1.self_attn.q_proj.weight"]
    assert described["hooks"] == ["Transpose(perm=None)"] and described["sharding"] == str(P("fsdp", "tp"))
    assert "model.norm.weight" in plan.unused
