"""``otfload.maxtext.load_state`` against the real MaxText (maxtext 0.2.5, in its own venv).

For each tiny family (Llama 3.1, Qwen3 tied and with MaxText's vocabulary padding, Qwen3-MoE,
Mixtral, DeepSeek-V3, V3.2 and V2-Lite, GPT-OSS, Gemma 2 and 3, OLMo 3, Qwen3-Next) and each layout
MaxText has (``scan_layers`` with ``param_scan_axis`` 1 and 0, unscanned; DeepSeek-V3.2 and Qwen3-Next
unscanned only, the one layout MaxText's loader loads them in: ``test_maxtext_deepseek32.py``,
``test_maxtext_qwen3_next.py``), MaxText builds its abstract NNX model on a 2x4 mesh of the 8 simulated
CPU devices and loads the multi-shard float32 checkpoint
with its own ``load_safetensors_dynamic_state``; the drop-in, given the same arguments (the weights MaxText's
checkpointing hands its loader: every variable but RNG state, so DeepSeek-V3's ``MoEBiasVar`` routing
bias too), must give every leaf bitwise equal, with the tree's dtype and sharding.

Where MaxText's own loader is wrong it is the reference no more: for MoE experts with
``param_scan_axis=0`` it stacks ``[experts, layers, ...]`` for a tree that wants ``[layers, experts,
...]`` (``tensor_handling.stacked_axes`` puts both stacked axes first whatever the config says), and
DeepSeek-V3's routing bias with ``param_scan_axis=1`` it stacks ``[experts, layers]`` (at
``param_scan_axis``) where MaxText scans that variable ``[layers, experts]``. There the test checks
that MaxText's leaf has the swapped shape, that otfload's has the tree's shape, and that otfload's
equals MaxText's with the two axes swapped back. GPT-OSS it cannot load at all (an
``AttributeError``: ``transform_hf_state_to_mt_state`` calls ``str.replace`` on the converter's
composite ``(wi_0, wi_1)`` keys); there the reference is MaxText's offline converter's steps
(``reference.maxtext_convert``), and otfload reads the experts in MXFP4 as published, the reference
their dequantised float32 values.

Then MaxText's forward pass on otfload's tree gives transformers' float32 logits (written by the
main venv: ``make_refs.py``) within 1e-4 x max|logits|, once per family, each family in another
layout (the MoE one MaxText cannot load among them). Qwen3 with tied embeddings is looser: MaxText's
``attend_on_embedding`` casts the embedding to bfloat16 for the logits whatever ``dtype`` says
(measured 2.2e-3 with MaxText's own loader), so that case allows 5e-3, as do the Gemmas (tied too;
Gemma 3's embedding is scaled by ``bfloat16(sqrt(48))`` where transformers' float32 forward uses
``sqrt(48)``: 1.4e-3 and 3.1e-3 measured). Gemma 3 is written for MaxText's converter under transformers'
module names; ``test_maxtext_gemma.py`` has the Hub's layout, and Gemma 2's query where MaxText's
converter is wrong.

Run: ``PYTHONPATH=. .venv-maxtext/bin/python -m pytest -q tests/maxtext`` (the venv:
``scripts/make_maxtext_venv.sh``); the main venv skips this module.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
# MaxText 0.2.5 on flax 0.12.12 / orbax 0.12.8 warns of its own deprecated calls a thousand times a run
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from tests.helpers import max_rel_diff  # noqa: E402
from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import FAMILIES, Family, layouts  # noqa: E402

EXPERT_LEAVES = ("wi_0", "wi_1", "wo")
# family -> the layout its forward pass runs in; tolerance x max|logits|
FORWARD = {"llama": ((True, 1), 1e-4), "qwen3": ((False, 1), 5e-3), "qwen3_moe": ((True, 0), 1e-4),
           "mixtral": ((True, 1), 1e-4), "deepseek3": ((True, 1), 1e-4), "deepseek32": ((True, 1), 1e-4),
           "deepseek2": ((True, 0), 1e-4), "gpt_oss": ((False, 1), 1e-4), "gemma2": ((False, 1), 5e-3),
           "gemma3": ((True, 1), 5e-3), "gemma2_qpas": ((False, 1), 5e-3), "olmo3": ((False, 1), 1e-4)}
# families MaxText's dynamic loader cannot load: the reference is its offline converter's steps
CONVERTED = {"gpt_oss"}
ROUTING_BIAS = "MoeBlock_0.gate.bias"

needs_drop_in = pytest.mark.skipif(importlib.util.find_spec("otfload.maxtext") is None,
                                   reason="otfload.maxtext (the drop-in) does not exist yet")


_BUILT: dict[tuple[str, bool, int], reference.Built] = {}
_LOADED: dict[tuple[str, bool, int], dict] = {}


def built(family: Family, layout: tuple[bool, int]) -> reference.Built:
    """MaxText's config and abstract model, built once per family and layout."""
    key = (family.name, *layout)
    if key not in _BUILT:
        _BUILT[key] = reference.build(family, *layout)
    return _BUILT[key]


def maxtext_loaded(family: Family, layout: tuple[bool, int], refs: Path) -> dict:
    """MaxText's own loader's tree, once per family and layout."""
    key = (family.name, *layout)
    if key not in _LOADED:
        load = reference.maxtext_convert if family.name in CONVERTED else reference.maxtext_load
        _LOADED[key] = load(built(family, layout), refs / family.checkpoint)
    return _LOADED[key]


def otfload_loaded(family: Family, layout: tuple[bool, int], refs: Path) -> dict:
    """The drop-in, called exactly as MaxText's loader is."""
    from otfload.maxtext import load_state

    b = built(family, layout)
    checkpoint = refs / (f"{family.checkpoint}_mxfp4" if family.mxfp4 else family.checkpoint)
    restored, tree = load_state(str(checkpoint), b.params, b.config)
    assert restored is None and set(tree) == {"params"}
    return tree


def misstacked(family: Family, layout: tuple[bool, int], leaf: str) -> bool:
    """A leaf MaxText's loader stacks with its two leading axes swapped: MoE experts scanned with
    the layer axis first, DeepSeek-V3's routing bias scanned at ``param_scan_axis`` 1."""
    if family.name in CONVERTED:
        return False
    experts = family.moe and layout == (True, 0) and leaf.rsplit(".", 1)[-1] in EXPERT_LEAVES
    return experts or layout == (True, 1) and leaf.endswith(ROUTING_BIAS)


def bits(x) -> np.ndarray:
    a = np.asarray(x)
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


# family -> the layouts it is loaded in: all of them, but the padding (a hook on the embedding, a leaf no
# layout changes) once
PADDED_LAYOUT = (False, 1)
CASES = [pytest.param(FAMILIES[name], layout, id=f"{name}-{'scan' if layout[0] else 'unscanned'}"
                      + (f"-axis{layout[1]}" if layout[0] else ""))
         for name in FAMILIES for layout in layouts(FAMILIES[name])
         if FAMILIES[name].maxtext_vocab is None or layout == PADDED_LAYOUT]


@pytest.mark.parametrize(("family", "layout"), [c for c in CASES if c.values[0].name not in CONVERTED])
def test_maxtext_loader_fills_its_tree(family, layout, refs):
    """MaxText's loader, the reference, maps every leaf of its tree, with the tree's sharding; its one
    wrong case has the swapped shape (so the next test's exception is a fact, not a guess)."""
    b = built(family, layout)
    want = reference.flat(b.params)
    have = reference.flat(maxtext_loaded(family, layout, refs)["params"])
    assert set(have) == set(want)
    for name, target in want.items():
        leaf = have[name]
        assert hasattr(leaf, "addressable_shards"), f"{name} left unloaded by MaxText"
        if misstacked(family, layout, name):
            assert leaf.shape == (target.shape[1], target.shape[0], *target.shape[2:]), name
        else:
            assert (leaf.shape, leaf.dtype, leaf.sharding) == (target.shape, target.dtype, target.sharding), name


def test_maxtext_loader_cannot_load_gpt_oss(refs):
    """The fact behind CONVERTED: MaxText 0.2.5's dynamic loader fails on GPT-OSS's composite keys."""
    with pytest.raises(AttributeError, match="'tuple' object has no attribute 'replace'"):
        reference.maxtext_load(built(FAMILIES["gpt_oss"], (False, 1)), refs / "gpt_oss")


@needs_drop_in
@pytest.mark.parametrize(("family", "layout"), CASES)
def test_drop_in_equals_maxtext_loader(family, layout, refs):
    """Every leaf bitwise equal to MaxText's loader's, with the tree's shape, dtype and sharding."""
    b = built(family, layout)
    want = reference.flat(b.params)
    ours = reference.flat(otfload_loaded(family, layout, refs)["params"])
    theirs = reference.flat(maxtext_loaded(family, layout, refs)["params"])
    assert set(ours) == set(want)
    for name, target in want.items():
        leaf = ours[name]
        assert (leaf.shape, leaf.dtype) == (target.shape, target.dtype), name
        assert leaf.sharding.is_equivalent_to(target.sharding, leaf.ndim), name
        if name.endswith(family.maxtext_differs):  # MaxText's converter is wrong there (test_maxtext_gemma.py)
            continue
        expected = np.swapaxes(np.asarray(theirs[name]), 0, 1) if misstacked(family, layout, name) else theirs[name]
        np.testing.assert_array_equal(bits(leaf), bits(expected), err_msg=name)


@needs_drop_in
@pytest.mark.parametrize("name", list(FORWARD))
def test_maxtext_forward_on_drop_in_matches_transformers(name, refs):
    """MaxText's own forward pass on the drop-in's tree gives transformers' logits."""
    family = FAMILIES[name]
    layout, tolerance = FORWARD[name]
    ids = np.load(refs / family.checkpoint / "ids.npy")
    expected = np.load(refs / family.checkpoint / "logits.npy")
    got = reference.logits(built(family, layout), otfload_loaded(family, layout, refs), ids)
    assert max_rel_diff(got, expected) <= tolerance, (name, layout, max_rel_diff(got, expected))


def test_padded_vocabulary_is_zero_rows(refs):
    """MaxText's padding, checked against the checkpoint itself: the first rows are the checkpoint's
    embedding, the rest zeros (so the bitwise comparison above also pins the padding)."""
    from safetensors.numpy import load_file

    family = FAMILIES["qwen3_padded"]
    loaded = reference.flat(maxtext_loaded(family, PADDED_LAYOUT, refs)["params"])
    embedding = np.asarray(loaded["token_embedder.embedding"])
    stored = {k: v for f in sorted((refs / family.checkpoint).glob("*.safetensors")) for k, v in load_file(f).items()}
    rows = stored["model.embed_tokens.weight"].shape[0]
    np.testing.assert_array_equal(embedding[:rows], stored["model.embed_tokens.weight"])
    assert embedding.shape[0] == family.maxtext_vocab and not embedding[rows:].any()



def test_deepseek3_mtp_layer(refs, tmp_path):
    """``mtp_num_layers: 1``: MaxText's tree has ``mtp_block.mtp_layer_1`` (the checkpoint's layer
    ``num_hidden_layers``, as the Hub's V3 stores it; here ``grouped.add_mtp_layer``'s random tensors).
    MaxText's loader maps none of it (it stays unmaterialised, so MaxText's own weight check refuses
    the load); the drop-in fills it as the numpy reference says, and every other leaf as MaxText's."""
    import dataclasses
    import shutil

    from safetensors.numpy import load_file

    from otfload.maxtext import load_state
    from tests.maxtext.models import LAYERS
    from tests.maxtext_tables.grouped import add_mtp_layer, mtp_leaves

    base = FAMILIES["deepseek3"]
    family = dataclasses.replace(base, maxtext_extra={**base.maxtext_extra, "mtp_num_layers": 1})
    path = tmp_path / "mtp"
    shutil.copytree(refs / base.checkpoint, path)
    add_mtp_layer(path, LAYERS)
    b = reference.build(family, False, 1)
    ours = reference.flat(load_state(str(path), b.params, b.config)[1]["params"])
    theirs = reference.flat(reference.maxtext_load(b, path)["params"])
    hf = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    fields = ("num_decoder_layers", "emb_dim", "num_query_heads", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "num_experts")
    mtp = mtp_leaves(hf, {name: getattr(b.config, name) for name in fields})
    assert set(ours) == set(reference.flat(b.params)) and set(mtp) <= set(ours)
    for name, leaf in ours.items():
        if name in mtp:
            assert not hasattr(theirs[name], "addressable_shards"), f"{name}: MaxText now loads it"
        np.testing.assert_array_equal(bits(leaf), bits(mtp.get(name, theirs[name])), err_msg=name)


def test_maxtext_loader_reads_fp8_codes_as_weights(refs):
    """DeepSeek-V3 as published (projections FP8 e4m3 with block scales): MaxText's loader returns the
    bare codes as ``float8_e4m3fn`` leaves of a float32 tree, the scales ignored (its weight check
    compares shapes only); the drop-in decodes them into float32 leaves within e4m3 rounding of the
    float checkpoint's (bitwise the dequantisation: tests/maxtext_tables)."""
    from otfload.maxtext import load_state

    family, layout = FAMILIES["deepseek3"], (False, 1)
    b = built(family, layout)
    path = refs / f"{family.checkpoint}_fp8"
    theirs = reference.flat(reference.maxtext_load(b, path)["params"])
    ours = reference.flat(load_state(str(path), b.params, b.config)[1]["params"])
    exact = reference.flat(maxtext_loaded(family, layout, refs)["params"])
    name = "decoder.moe_layers_0.self_attention.wkv_b.kernel"
    assert str(theirs[name].dtype) == "float8_e4m3fn" and max_rel_diff(theirs[name], exact[name]) > 10
    assert ours[name].dtype == np.float32 and max_rel_diff(ours[name], exact[name]) <= 2**-4
