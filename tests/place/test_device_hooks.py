"""Hooks on the device: every family's leaves, laid out by the jitted device functions from raw
source boxes, are bitwise the host route's (numpy hooks, one np.stack) — run on CPU devices, where the
route is forced (``OTFLOAD_DEVICE_HOOKS=always``); on accelerators it is the default."""

import logging

import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.errors import InvalidOptionError
from otfload.place import device_hooks
from otfload.plan.boxes import box_from_index
from tests.families import test_deepseek, test_gemma, test_gpt_oss, test_mixtral, test_qwen3_moe  # noqa: F401  (kinds)

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "mixtral", "qwen3_moe", "deepseek_v2",
            "deepseek_v3", "gpt_oss"]
CASES = [(kind, True, None) for kind in FAMILIES] + [("llama", False, None), ("deepseek_v3", False, None),
                                                     ("llama", True, "bfloat16")]


def leaves(model) -> dict[str, np.ndarray]:
    state = nnx.to_flat_state(nnx.state(model, nnx.Param))
    return {".".join(map(str, path)): np.asarray(var.get_value()) for path, var in state}


@pytest.mark.parametrize("kind,scan,dtype", CASES)
def test_device_route_is_bitwise_the_host_route(tiny_checkpoints, mesh_2x4, monkeypatch, kind, scan, dtype):
    path, _ = tiny_checkpoints(kind)
    host = leaves(otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan, dtype=dtype))
    monkeypatch.setenv(device_hooks.DEVICE_HOOKS_ENV, "always")
    laid_out = []
    real = device_hooks.place_on_devices

    def counting(plan, box_of, raw):
        laid_out.append(plan.path)
        return real(plan, box_of, raw)

    monkeypatch.setattr("otfload.place.builder.place_on_devices", counting)
    device = leaves(otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan, dtype=dtype))
    assert laid_out  # the route really ran (leaves with hooks or a cast)
    assert host.keys() == device.keys()
    for name in host:
        assert host[name].dtype == device[name].dtype, name
        assert host[name].tobytes() == device[name].tobytes(), name


def test_policy_is_checked(monkeypatch, tmp_path):
    monkeypatch.setenv(device_hooks.DEVICE_HOOKS_ENV, "sometimes")
    with pytest.raises(InvalidOptionError, match="OTFLOAD_DEVICE_HOOKS='sometimes'"):
        otfload.from_pretrained(tmp_path / "never-opened")  # checked at the front door, before the source


def test_layouts_are_compiled_ahead_from_the_plan_alone(tiny_checkpoints, mesh_2x4, monkeypatch, caplog):
    """Before any byte is read, the plan gives every device box's layout function and its input: they
    compile in the background, and a load then finds them compiled."""
    path, _ = tiny_checkpoints("llama")
    _, plan, src = otfload.plan_model(path, mesh=mesh_2x4)
    src.close()
    laid = [p for p in plan.leaves.values() if device_hooks.hooks_on_device(p, "always")]
    pool = device_hooks.compile_ahead(plan.leaves.values(), "always")
    assert pool is not None and laid
    pool.shutdown(wait=True)
    import jax

    for leaf_plan in laid:
        device, box = next(iter(leaf_plan.leaf.sharding.addressable_devices_indices_map(leaf_plan.leaf.shape).items()))
        layout, spec = device_hooks._layout_of(leaf_plan, box_from_index(box, leaf_plan.leaf.shape))
        caplog.clear()
        with caplog.at_level(logging.WARNING), jax.log_compiles(True):
            layout(jax.device_put(np.zeros(spec.shape, spec.dtype), device))
        assert not [r for r in caplog.records if "Compiling" in r.getMessage()], leaf_plan.path  # compiled ahead
    assert device_hooks.compile_ahead(plan.leaves.values(), "never") is None  # nothing laid out on devices
