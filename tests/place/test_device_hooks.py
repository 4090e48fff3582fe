"""Hooks on the device: every family's leaves, laid out by the jitted device functions from raw
source boxes, are bitwise the host route's (numpy hooks, one np.stack) — run on CPU devices, where the
route is forced (``OTFLOAD_DEVICE_HOOKS=always``); on accelerators it is the default."""

import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.errors import InvalidOptionError
from otfload.place import device_hooks
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


def test_policy_is_checked(monkeypatch):
    monkeypatch.setenv(device_hooks.DEVICE_HOOKS_ENV, "sometimes")
    with pytest.raises(InvalidOptionError, match="OTFLOAD_DEVICE_HOOKS"):
        device_hooks.device_hooks_policy()
