import jax
import jax.numpy as jnp
import numpy as np
import pytest

from otfload.checkpoint import detect_scan_layers, stack_layers, unstack_layers
from otfload.checkpoint import layout as layout_module
from otfload.errors import LayerLayoutError

L = 4


def _unscanned(tuple_keys: bool = False) -> dict:
    rng = np.random.default_rng(0)
    flat = {"model.embed": rng.standard_normal((10, 3))}
    for i in range(L):
        flat[f"model.layers.{i}.attn.q"] = rng.standard_normal((3, 2))
        flat[f"model.layers.{i}.norm"] = rng.standard_normal(3)
    if tuple_keys:
        return {tuple(int(p) if p.isdigit() else p for p in k.split(".")): v for k, v in flat.items()}
    return flat


def test_stack_dotted_keys_gives_leading_layer_axis():
    flat = _unscanned()
    scanned = stack_layers(flat)
    assert set(scanned) == {"model.embed", "model.layers.attn.q", "model.layers.norm"}
    assert scanned["model.layers.attn.q"].shape == (L, 3, 2)
    np.testing.assert_array_equal(scanned["model.layers.attn.q"][2], flat["model.layers.2.attn.q"])
    assert scanned["model.embed"] is flat["model.embed"]


def test_round_trip_is_exact_for_dotted_and_tuple_keys():
    for tuple_keys in (False, True):
        flat = _unscanned(tuple_keys)
        back = unstack_layers(stack_layers(flat))
        assert back.keys() == flat.keys()
        for key, value in flat.items():
            np.testing.assert_array_equal(back[key], value)
    assert ("model", "layers", 3, "norm") in unstack_layers(stack_layers(_unscanned(True)))


def test_one_stack_call_per_stacked_leaf(monkeypatch):
    calls = []
    real_stack = np.stack
    monkeypatch.setattr(
        layout_module.np, "stack", lambda xs, **kw: calls.append(len(xs)) or real_stack(xs, **kw)
    )
    stack_layers(_unscanned())
    assert calls == [L, L]


def test_jax_arrays_stay_jax_arrays_with_layers_under_several_prefixes():
    flat = {
        f"{side}.layers.{i}.w": jnp.full((2,), i + (10 if side == "decoder" else 0), jnp.float32)
        for side in ("encoder", "decoder")
        for i in range(3)
    }
    scanned = stack_layers(flat)
    assert isinstance(scanned["decoder.layers.w"], jax.Array)
    np.testing.assert_array_equal(scanned["decoder.layers.w"][:, 0], [10, 11, 12])
    unscanned = unstack_layers(scanned)
    assert isinstance(unscanned["encoder.layers.1.w"], jax.Array)
    np.testing.assert_array_equal(unscanned["encoder.layers.1.w"], [1, 1])


def test_detect_scan_layers():
    assert detect_scan_layers(_unscanned()) is False
    assert detect_scan_layers(stack_layers(_unscanned())) is True
    assert detect_scan_layers({"embed": 0, "lm_head": 1}) is None
    with pytest.raises(LayerLayoutError, match="mixes"):
        detect_scan_layers(["a.layers.0.w", "a.layers.w"])


def test_gap_in_layer_indices_is_an_error():
    flat = _unscanned()
    del flat["model.layers.1.norm"]
    with pytest.raises(LayerLayoutError, match=r"model.layers.norm.*\[0, 2, 3\]"):
        stack_layers(flat)


def test_scalar_cannot_be_unstacked_and_collisions_are_reported():
    with pytest.raises(LayerLayoutError, match="no leading layer axis"):
        unstack_layers({"layers.w": np.float32(1.0)})
    with pytest.raises(LayerLayoutError, match="collides"):
        stack_layers({"layers.0.w": np.ones(2), "layers.w": np.ones((1, 2))})
