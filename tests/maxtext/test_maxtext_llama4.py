"""Llama 4 against the real MaxText (maxtext 0.2.5, its venv). MaxText has a Llama 4 decoder but no
converter mapping for it (``param_mapping.PARAM_MAPPING`` has no ``llama4`` entry): its dynamic loader
cannot load it, and there is no loader to compare with. ``otfload/maxtext/llama4.py`` is written from
its model code; the bar is MaxText's own forward pass.

One tiny checkpoint in ``llama4-17b-128e``'s layer pattern (8 layers; every second MoE with a shared
expert, the others dense; every fourth NoPE; chunked attention over 8 of 12 tokens), stored as the Hub's
multimodal releases store it (``language_model.model.*``, a vision tower never read). In every layout
MaxText has: the drop-in fills MaxText's own abstract tree (every path, shape, dtype, sharding); unscanned,
every leaf is numpy's reading of the checkpoint (kernels transposed and split into heads, the fused
experts' halves); scanned, every leaf is the unscanned layers stacked at ``param_scan_axis``; ``export``
gives every text tensor back, bit-exact. Then MaxText's forward on the scanned drop-in gives
transformers' float32 logits within 1e-4 x max|logits|."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from tests.helpers import hf_tensors, max_rel_diff  # noqa: E402
from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import EXPERTS, FAMILIES, HEAD_DIM, HEADS, KV_HEADS, LAYOUTS, MOE_MLP  # noqa: E402
from tests.maxtext.test_maxtext_drop_in import built  # noqa: E402

FAMILY = FAMILIES["llama4"]
PERIOD, STEP = 4, 2  # MaxText's scanned block (the NoPE interval), the MoE interleave step
HUB = f"{FAMILY.checkpoint}_hub"
IDS = {layout: f"scan-axis{layout[1]}" if layout[0] else "unscanned" for layout in LAYOUTS}
_LOADED: dict[tuple[bool, int], dict] = {}


def loaded(refs, layout: tuple[bool, int]) -> dict:
    """The drop-in on the Hub-layout checkpoint, called as MaxText calls its loader, once per layout."""
    from otfload.maxtext import load_state

    if layout not in _LOADED:
        b = built(FAMILY, layout)
        restored, tree = load_state(str(refs / HUB), b.params, b.config)
        assert restored is None
        _LOADED[layout] = reference.flat(tree["params"])
    return _LOADED[layout]


def layer(hf: dict, i: int) -> dict[str, np.ndarray]:
    """HF layer ``i``'s MaxText leaves, in numpy."""
    p = f"language_model.model.layers.{i}"
    a, f = f"{p}.self_attn", f"{p}.feed_forward"
    out = {"pre_self_attention_layer_norm.scale": hf[f"{p}.input_layernorm.weight"],
           "post_self_attention_layer_norm.scale": hf[f"{p}.post_attention_layernorm.weight"],
           "self_attention.query.kernel": hf[f"{a}.q_proj.weight"].T.reshape(-1, HEADS, HEAD_DIM),
           "self_attention.key.kernel": hf[f"{a}.k_proj.weight"].T.reshape(-1, KV_HEADS, HEAD_DIM),
           "self_attention.value.kernel": hf[f"{a}.v_proj.weight"].T.reshape(-1, KV_HEADS, HEAD_DIM),
           "self_attention.out.kernel": hf[f"{a}.o_proj.weight"].T.reshape(HEADS, HEAD_DIM, -1)}
    mlp = [("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")]
    if (i + 1) % STEP:
        return {**out, **{f"mlp.{m}.kernel": hf[f"{f}.{h}.weight"].T for m, h in mlp}}
    moe, gate_up = "Llama4MoEBlock_0", hf[f"{f}.experts.gate_up_proj"]
    assert gate_up.shape[0] == EXPERTS
    return {**out, f"{moe}.MoeBlock_0.gate.kernel": hf[f"{f}.router.weight"].T,
            f"{moe}.MoeBlock_0.wi_0": gate_up[..., :MOE_MLP], f"{moe}.MoeBlock_0.wi_1": gate_up[..., MOE_MLP:],
            f"{moe}.MoeBlock_0.wo": hf[f"{f}.experts.down_proj"],
            **{f"{moe}.shared_experts.{m}.kernel": hf[f"{f}.shared_expert.{h}.weight"].T for m, h in mlp}}


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS.get)
def test_drop_in_fills_maxtexts_tree(refs, layout):
    want = reference.flat(built(FAMILY, layout).params)
    ours = loaded(refs, layout)
    assert set(ours) == set(want)
    for name, target in want.items():
        assert (ours[name].shape, ours[name].dtype) == (target.shape, target.dtype), name
        assert ours[name].sharding.is_equivalent_to(target.sharding, target.ndim), name


def test_unscanned_leaves_are_the_checkpoints(refs):
    hf = hf_tensors(refs / HUB)
    ours = loaded(refs, (False, 1))
    want = {"token_embedder.embedding": hf["language_model.model.embed_tokens.weight"],
            "decoder.decoder_norm.scale": hf["language_model.model.norm.weight"],
            "decoder.logits_dense.kernel": hf["language_model.lm_head.weight"].T}
    for i in range(FAMILY.hf_extra["num_hidden_layers"]):
        want |= {f"decoder.layers_{i}.{k}": v for k, v in layer(hf, i).items()}
    assert sorted(ours) == sorted(want)
    for name, value in want.items():
        np.testing.assert_array_equal(np.asarray(ours[name]), value, err_msg=name)


@pytest.mark.parametrize("axis", [1, 0])
def test_scanned_leaves_stack_the_unscanned_ones(refs, axis):
    """``decoder.layers.layers_<j>`` holds HF layers ``j, j + 4, ...`` at ``param_scan_axis``."""
    flat, scanned = loaded(refs, (False, 1)), loaded(refs, (True, axis))
    layers = FAMILY.hf_extra["num_hidden_layers"]
    for name, leaf in scanned.items():
        if not name.startswith("decoder.layers."):
            np.testing.assert_array_equal(np.asarray(leaf), np.asarray(flat[name]), err_msg=name)
            continue
        j, rest = name.removeprefix("decoder.layers.layers_").split(".", 1)
        parts = [np.asarray(flat[f"decoder.layers_{i}.{rest}"]) for i in range(int(j), layers, PERIOD)]
        # MaxText scans the layer axis in at param_scan_axis, after an expert stack's leading axis
        np.testing.assert_array_equal(np.asarray(leaf), np.stack(parts, axis=axis), err_msg=name)


@pytest.mark.parametrize("layout", [(True, 1), (False, 1)], ids=IDS.get)
def test_export_gives_the_checkpoint_back(refs, tmp_path, layout):
    from otfload.maxtext import export

    out = export(_unflat(loaded(refs, layout)), tmp_path / "hf", built(FAMILY, layout).config, reference=refs / HUB)
    written, original = hf_tensors(out), hf_tensors(refs / HUB)
    text = {k: v for k, v in original.items() if k.startswith("language_model.")}
    assert sorted(written) == sorted(text)
    for key, value in text.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)


@pytest.mark.parametrize(("model_name", "step"), [("llama4-17b-16e", 1), ("llama4-17b-128e", 2)])
@pytest.mark.parametrize("layout", [(True, 1), (False, 1)], ids=IDS.get)
def test_the_tree_otfload_builds_is_maxtexts(model_name, step, layout):
    """Both tables (16E: every layer MoE, its qk-norm config; 128E: every second) against MaxText's own
    abstract tree: every leaf path, shape and sharding (the 16E checkpoint is loaded by hand only:
    docs/maxtext.md)."""
    import dataclasses

    import otfload.maxtext as mx

    if model_name == FAMILY.model_name:
        b = built(FAMILY, layout)
    else:
        b = reference.build(dataclasses.replace(FAMILY, model_name=model_name, maxtext_extra={
            **FAMILY.maxtext_extra, "interleave_moe_layer_step": step}), *layout)
    want = reference.flat(b.params)
    ours = reference.flat(mx.abstract_params(b.config, b.mesh))
    assert sorted(ours) == sorted(want)
    for name, target in want.items():
        assert ours[name].shape == target.shape, name
        assert ours[name].sharding.is_equivalent_to(target.sharding, target.ndim), name


def test_maxtext_forward_on_the_drop_in_matches_transformers(refs):
    layout = (True, 1)
    ids = np.load(refs / FAMILY.checkpoint / "ids.npy")
    expected = np.load(refs / FAMILY.checkpoint / "logits.npy")
    got = reference.logits(built(FAMILY, layout), {"params": _unflat(loaded(refs, layout))}, ids)
    assert max_rel_diff(got, expected) <= 1e-4, max_rel_diff(got, expected)


def _unflat(leaves: dict) -> dict:
    import flax.traverse_util

    return flax.traverse_util.unflatten_dict(leaves, sep=".")
