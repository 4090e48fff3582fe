import jax
import pytest
from jax.sharding import PartitionSpec as P

from otfload.errors import OtfloadError
from otfload.plan.sharding import logical_to_spec, make_mesh, parse_mesh_spec


def test_parse_mesh_spec():
    assert parse_mesh_spec("fsdp=4,tp=2") == {"fsdp": 4, "tp": 2}
    for bad in ["", "fsdp", "fsdp=x", "a=1,a=2"]:
        with pytest.raises(OtfloadError):
            parse_mesh_spec(bad)


def test_make_mesh_defaults_and_inference():
    assert dict(make_mesh().shape) == {"fsdp": len(jax.devices())}
    assert dict(make_mesh("fsdp=-1,tp=4").shape) == {"fsdp": 2, "tp": 4}
    with pytest.raises(OtfloadError, match="needs 6 devices"):
        make_mesh({"a": 3, "b": 2})


def test_rules_map_logical_axes(mesh_2x4):
    assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 16), mesh_2x4) == P("fsdp", "tp")
    assert logical_to_spec(("layers", "embed", "mlp"), (3, 64, 128), mesh_2x4) == P(None, "fsdp", "tp")


def test_indivisible_or_reused_axes_are_replicated(mesh_2x4):
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 16), mesh_2x4) == P("fsdp")
    assert logical_to_spec(("mlp", "mlp"), (8, 8), mesh_2x4) == P("tp")
    assert logical_to_spec(("experts", "embed"), (4, 64), mesh_2x4) == P(None, "fsdp")  # no "ep" axis
    assert logical_to_spec(None, (3,), mesh_2x4) == P()
