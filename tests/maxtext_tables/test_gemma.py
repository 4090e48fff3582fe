"""The Gemma 2 and Gemma 3 MaxText tables against numpy: every leaf of MaxText's tree in every
layout, bitwise what MaxText's converter (``param_mapping.GEMMA2_*`` / ``GEMMA3_*``) gives — norms
plus one, the embedding times ``float32(sqrt(hidden))`` (Gemma 2) or ``bfloat16(sqrt(hidden))``
(Gemma 3; hidden 48, so the two differ), Gemma 2's query times ``1/sqrt(query_pre_attn_scalar)``
(24 here, not ``head_dim``), Gemma 2's pairs of HF layers, Gemma 3's blocks of six plus the
remainder (13 layers: two blocks and one left over); Gemma 3's text model read under either
multimodal prefix layout, the vision tower never; export back to HF, exact but for the rounding of
the scales and the ``+ 1``."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.errors import ConfigError
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, module_name, register_hf_model, rename_tensors
from tests.maxtext_tables.support import LAYOUTS, _kernel, _pad
from tests.maxtext_tables.test_tables import check

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 48, 8, 4, 16, 96, 256
GEMMA2_LAYERS, GEMMA3_LAYERS, QUERY_PRE_ATTN_SCALAR = 4, 13, 24
_BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=MLP, num_attention_heads=HEADS,
             num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=128,
             query_pre_attn_scalar=QUERY_PRE_ATTN_SCALAR)


def _gemma2(**kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    return Gemma2ForCausalLM(Gemma2Config(**{**_BASE, "num_hidden_layers": GEMMA2_LAYERS, **kw}))


def _gemma3(**kw):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {**_BASE, "num_hidden_layers": GEMMA3_LAYERS, **kw}
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))


register_hf_model("mt_gemma2", _gemma2)
register_hf_model("mt_gemma3", _gemma3)
KINDS = {"mt_gemma2": ("gemma2-2b", GEMMA2_LAYERS // 2), "mt_gemma3": ("gemma3-4b", GEMMA3_LAYERS)}
HUB_TEXT = "language_model.model."  # where the Hub's (and save_pretrained's) Gemma 3 keeps its text model
MODULE_TEXT = "model.language_model."  # transformers' module names, which MaxText's converter reads


def maxtext_config(kind: str, scan_layers: bool, param_scan_axis: int, **over) -> dict:
    model_name, layers = KINDS[kind]
    return {**dict(model_name=model_name, scan_layers=scan_layers, param_scan_axis=param_scan_axis, vocab_size=VOCAB,
                   emb_dim=HIDDEN, num_query_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, mlp_dim=MLP,
                   num_decoder_layers=layers, logits_via_embedding=True), **over}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


NORMS = {"pre_self_attention_norm": "input_layernorm", "post_self_attention_norm": "post_attention_layernorm",
         "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
ONE = np.float32(1.0)


def hf_layer(hf: dict, prefix: str, i: int, suffix: str = "", query_scale: float | None = None) -> dict:
    """HF layer ``i`` under MaxText's names (``suffix``: Gemma 2's ``_local`` / ``_global``)."""
    p, attn = f"{prefix}layers.{i}", f"self_attention{suffix}"
    out = {f"{mt}{suffix}.scale": hf[f"{p}.{name}.weight"] + ONE for mt, name in NORMS.items()}
    q = _kernel(hf[f"{p}.self_attn.q_proj.weight"], HIDDEN, HEADS, HEAD_DIM)
    out[f"{attn}.query.kernel"] = q if query_scale is None else q * np.float32(query_scale)
    out[f"{attn}.key.kernel"] = _kernel(hf[f"{p}.self_attn.k_proj.weight"], HIDDEN, KV_HEADS, HEAD_DIM)
    out[f"{attn}.value.kernel"] = _kernel(hf[f"{p}.self_attn.v_proj.weight"], HIDDEN, KV_HEADS, HEAD_DIM)
    out[f"{attn}.out.kernel"] = _kernel(hf[f"{p}.self_attn.o_proj.weight"], HEADS, HEAD_DIM, HIDDEN)
    if f"{p}.self_attn.q_norm.weight" in hf:
        out["self_attention.query_norm.scale"] = hf[f"{p}.self_attn.q_norm.weight"] + ONE
        out["self_attention.key_norm.scale"] = hf[f"{p}.self_attn.k_norm.weight"] + ONE
    for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
        out[f"mlp{suffix}.{leaf}.kernel"] = hf[f"{p}.mlp.{name}.weight"].T
    return out


def _stacked(name: str, layers: list[dict], axis: int) -> dict:
    return {f"{name}.{k}": np.stack([leaves[k] for leaves in layers], axis=axis) for k in layers[0]}


def expected(kind: str, hf: dict, cfg: dict, prefix: str = "model.") -> dict:
    """Every MaxText leaf for the layout ``cfg`` names, from MaxText's converter's arithmetic."""
    scale = np.float32(HIDDEN**0.5) if kind == "mt_gemma2" else np.float32(np.dtype("bfloat16").type(HIDDEN**0.5))
    out = {"token_embedder.embedding": _pad(hf[f"{prefix}embed_tokens.weight"] * scale, 0, cfg["vocab_size"]),
           "decoder.decoder_norm.scale": hf[f"{prefix}norm.weight"] + ONE}
    n, axis = cfg["num_decoder_layers"], cfg["param_scan_axis"]
    if kind == "mt_gemma2":
        q = 1 / np.sqrt(QUERY_PRE_ATTN_SCALAR)
        layers = [{**hf_layer(hf, prefix, 2 * i, "_local", q), **hf_layer(hf, prefix, 2 * i + 1, "_global", q)}
                  for i in range(n)]
        if cfg["scan_layers"]:
            return {**out, **_stacked("decoder.layers", layers, axis)}
    else:
        layers = [hf_layer(hf, prefix, i) for i in range(n)]
        if cfg["scan_layers"]:
            blocks, rest = divmod(n, 6)
            for j in range(6):
                out.update(_stacked(f"decoder.layers.layers_{j}", layers[j:6 * blocks:6], axis))
            for r in range(rest):
                out.update({f"decoder.layers_remainder.layers_{r}.{k}": v for k, v in layers[6 * blocks + r].items()})
            return out
    return {**out, **{f"decoder.layers_{i}.{k}": v for i, leaves in enumerate(layers) for k, v in leaves.items()}}


def _load(path, cfg, mesh):
    abstract = mx.abstract_params(cfg, mesh)
    return mx.load_state(str(path), abstract, cfg)[1]["params"], abstract


@pytest.mark.parametrize("kind", sorted(KINDS))
@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_every_leaf_is_maxtexts_layout(tiny_checkpoints, mesh, kind, scan, axis):
    path, _ = tiny_checkpoints(kind)
    cfg = maxtext_config(kind, scan, axis)
    params, abstract = _load(path, cfg, mesh)
    check(params, expected(kind, hf_tensors(path), cfg, "model." if kind == "mt_gemma2" else HUB_TEXT), abstract)


def test_gemma3_under_transformers_module_names_and_padded(tiny_checkpoints, mesh, tmp_path):
    """The layout MaxText's converter reads (``model.language_model.``) loads the same leaves; a
    larger ``vocab_size`` pads the scaled embedding with zero rows."""
    src, _ = tiny_checkpoints("mt_gemma3")
    path = tmp_path / "module_names"
    shutil.copytree(src, path)
    rename_tensors(path, module_name)
    cfg = maxtext_config("mt_gemma3", True, 1, vocab_size=VOCAB + 64)
    params, abstract = _load(path, cfg, mesh)
    check(params, expected("mt_gemma3", hf_tensors(path), cfg, MODULE_TEXT), abstract)
    assert not np.asarray(params["token_embedder"]["embedding"])[VOCAB:].any()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_export_round_trip(tiny_checkpoints, mesh, tmp_path, kind):
    """Back to HF: the reference's keys and dtypes; kernels bit-exact, the norms (``- 1``) and the
    scaled embedding and query (divided back) exact to float32 rounding."""
    path, _ = tiny_checkpoints(kind)
    cfg = maxtext_config(kind, True, 1)
    params, _ = _load(path, cfg, mesh)
    mx.export(params, tmp_path / "out", cfg, reference=path)
    written, original = hf_tensors(tmp_path / "out"), hf_tensors(path)
    text = {k for k in original if "vision" not in k and "multi_modal" not in k}
    assert sorted(written) == sorted(text)
    for key in text:
        assert written[key].dtype == original[key].dtype, key
        if "norm" in key or "embed_tokens" in key or "q_proj" in key:
            np.testing.assert_allclose(written[key], original[key], rtol=2e-7, atol=6e-8, err_msg=key)
        else:
            np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_gemma2_layer_count_counts_pairs(tiny_checkpoints, mesh):
    """MaxText's Gemma 2 ``num_decoder_layers`` counts (local, global) pairs: the HF layer count there
    is a tree with other layers, refused before any read."""
    path, _ = tiny_checkpoints("mt_gemma2")
    cfg = maxtext_config("mt_gemma2", False, 1)
    abstract = mx.abstract_params({**cfg, "num_decoder_layers": GEMMA2_LAYERS}, mesh)
    with pytest.raises(ConfigError) as info:
        mx.load_state(str(path), abstract, cfg)
    assert info.value.field == "num_decoder_layers" and "'gemma2'" in str(info.value)


def test_gemma3_without_a_full_block_has_only_the_remainder(tiny_checkpoints, mesh):
    """Fewer than six layers scanned: no ``decoder.layers`` at all, every layer in the remainder."""
    cfg = maxtext_config("mt_gemma3", True, 1, num_decoder_layers=4)
    paths = set(_flat_paths(mx.abstract_params(cfg, mesh)))
    assert not any(p.startswith("decoder.layers.") for p in paths)
    assert {p.split(".")[2] for p in paths if p.startswith("decoder.layers_remainder.")} == {f"layers_{r}"
                                                                                            for r in range(4)}


def _flat_paths(tree, prefix=""):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat_paths(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}"
