"""The Gemma 4 MaxText tables (26B MoE, 31B dense) against numpy: every leaf of MaxText's tree in
both scanned layouts, bitwise what MaxText's converter (``param_mapping.GEMMA4_*``) gives — kernels
``[in, out]`` with heads split (global layers with ``global_head_dim`` / ``global_num_kv_heads`` and
no value kernel: k = v), norms, ``layer_scalar``, router scales as stored, the fused
``gate_up_proj`` halves as ``wi_0`` / ``wi_1``, the embedding times ``float32(sqrt(hidden))``;
scanned, ``scanned_blocks.local_layers`` ``[blocks, 5]``, ``scanned_blocks.global_layer`` every sixth
layer (12 layers: two blocks); unscanned, ``decoder.layers_<i>`` with each kind's attention at the same
paths (global every sixth: ``Rule.only``); the text model of a multimodal checkpoint, exported back under
``model.language_model.`` (exact but for the embedding scale's rounding). Gemma 4 E2B (``gemma4-e2b``,
unscanned only): its sliding / global layers of period 5, the keys and values only before the shared tail,
the tail's double-wide MLPs, the per-layer inputs and embedder, the same way."""

from __future__ import annotations

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.errors import ConfigError
from otfload.plan.sharding import make_mesh
from tests.families.test_gemma4 import MOE, TEXT, VISION, _random_layer_scalars
from tests.helpers import hf_tensors, register_hf_model
from tests.maxtext_tables.support import LAYOUTS, _kernel, _pad
from tests.maxtext_tables.test_tables import check

S, F = "sliding_attention", "full_attention"
LAYERS, BLOCK = 12, 6
HIDDEN, HEADS, KV, HD, GKV, GHD, EXPERTS, FF = 64, 8, 4, 16, 4, 32, 8, 32
PREFIX = "model.language_model."


def _gemma4(**kw):
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text = {**TEXT, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS, "num_key_value_heads": KV,
            "num_global_key_value_heads": GKV, "layer_types": [F if i % BLOCK == BLOCK - 1 else S
                                                               for i in range(LAYERS)], **kw}
    model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=text, vision_config=VISION))
    _random_layer_scalars(model)
    return model


register_hf_model("mt_gemma4_moe", _gemma4, MOE)
register_hf_model("mt_gemma4", _gemma4)
KINDS = {"mt_gemma4_moe": "gemma4-26b", "mt_gemma4": "gemma4-31b"}


def maxtext_config(kind: str, scan_layers: bool, param_scan_axis: int, **over) -> dict:
    return {**dict(model_name=KINDS[kind], scan_layers=scan_layers, param_scan_axis=param_scan_axis,
                   vocab_size=TEXT["vocab_size"], emb_dim=HIDDEN, num_query_heads=HEADS, num_kv_heads=KV,
                   head_dim=HD, global_head_dim=GHD, global_num_kv_heads=GKV, mlp_dim=TEXT["intermediate_size"],
                   moe_mlp_dim=FF, num_experts=EXPERTS, num_decoder_layers=LAYERS, logits_via_embedding=True), **over}


def layer(hf: dict, i: int, moe: bool) -> dict:
    """HF layer ``i``'s MaxText leaves (experts first)."""
    p = f"{PREFIX}layers.{i}"
    a, full = f"{p}.self_attn", i % BLOCK == BLOCK - 1
    kv, hd = (GKV, GHD) if full else (KV, HD)
    out = {f"{mt}.scale": hf[f"{p}.{name}.weight"] for mt, name in (
        ("pre_self_attention_norm", "input_layernorm"), ("post_self_attention_norm", "post_attention_layernorm"),
        ("pre_ffw_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"))}
    out |= {"layer_scalar": hf[f"{p}.layer_scalar"],
            "self_attention.query.kernel": _kernel(hf[f"{a}.q_proj.weight"], HIDDEN, HEADS, hd),
            "self_attention.key.kernel": _kernel(hf[f"{a}.k_proj.weight"], HIDDEN, kv, hd),
            "self_attention.out.kernel": _kernel(hf[f"{a}.o_proj.weight"], HEADS, hd, HIDDEN),
            "self_attention.query_norm.scale": hf[f"{a}.q_norm.weight"],
            "self_attention.key_norm.scale": hf[f"{a}.k_norm.weight"]}
    if not full:
        out["self_attention.value.kernel"] = _kernel(hf[f"{a}.v_proj.weight"], HIDDEN, kv, hd)
    dense = "mlp.moe_block.shared_experts" if moe else "mlp"
    for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
        out[f"{dense}.{leaf}.kernel"] = hf[f"{p}.mlp.{name}.weight"].T
    if moe:
        x, fused = "mlp.moe_block.MoeBlock_0", hf[f"{p}.experts.gate_up_proj"]
        out |= {f"mlp.{n}.scale": hf[f"{p}.{n}.weight"] for n in
                ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2")}
        out |= {"mlp.pre_forward_scale_2": hf[f"{p}.router.scale"], f"{x}.gate.kernel": hf[f"{p}.router.proj.weight"].T,
                f"{x}.wi_0": fused[:, :FF].transpose(0, 2, 1), f"{x}.wi_1": fused[:, FF:].transpose(0, 2, 1),
                f"{x}.wo": hf[f"{p}.experts.down_proj"].transpose(0, 2, 1),
                f"{x}.per_expert_scale": hf[f"{p}.router.per_expert_scale"]}
    return out


def _stack(rows: list[dict], axis: int) -> dict:
    return {k: np.stack([r[k] for r in rows], axis) for k in rows[0]}


def expected(hf: dict, cfg: dict, moe: bool) -> dict:
    embedding = _pad(hf[f"{PREFIX}embed_tokens.weight"] * np.float32(np.sqrt(HIDDEN)), 0, cfg["vocab_size"])
    out = {"token_embedder.embedding": embedding, "decoder.decoder_norm.scale": hf[f"{PREFIX}norm.weight"]}
    layers = [layer(hf, i, moe) for i in range(LAYERS)]
    if not cfg["scan_layers"]:
        return out | {f"decoder.layers_{i}.{k}": v for i, leaves in enumerate(layers) for k, v in leaves.items()}
    axis, blocks = cfg["param_scan_axis"], LAYERS // BLOCK
    scanned = {"scanned_blocks.global_layer": _stack([layers[b * BLOCK + BLOCK - 1] for b in range(blocks)], axis)}
    # [blocks, 5] at param_scan_axis and the next one: each block's positions, then the blocks
    local = [_stack(layers[b * BLOCK:b * BLOCK + BLOCK - 1], axis) for b in range(blocks)]
    scanned["scanned_blocks.local_layers"] = _stack(local, axis)
    return out | {f"decoder.{group}.{k}": v for group, leaves in scanned.items() for k, v in leaves.items()}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


CASES = [(kind, *layout) for kind in sorted(KINDS) for layout in LAYOUTS]


@pytest.mark.parametrize(("kind", "scan", "axis"), CASES)
def test_every_leaf_is_maxtexts_layout_and_exports_back(tiny_checkpoints, mesh, tmp_path, kind, scan, axis):
    path, _ = tiny_checkpoints(kind)
    cfg, original = maxtext_config(kind, scan, axis, vocab_size=320), hf_tensors(path)
    params = mx.load_state(str(path), abstract := mx.abstract_params(cfg, mesh), cfg)[1]["params"]
    check(params, expected(original, cfg, kind == "mt_gemma4_moe"), abstract)
    mx.export(params, tmp_path / "out", cfg, reference=path)
    written = hf_tensors(tmp_path / "out")
    assert sorted(written) == sorted(k for k in original if k.startswith(PREFIX))
    for key, value in written.items():
        assert value.dtype == original[key].dtype, key
        np.testing.assert_allclose(value, original[key], rtol=2e-7, atol=0, err_msg=key)
        if "embed_tokens" not in key:
            np.testing.assert_array_equal(value, original[key], err_msg=key)


def test_a_global_value_kernel_is_refused(tiny_checkpoints, mesh):
    """A tree with a global layer's value kernel (``share_kv_projections: false``): no rule maps it."""
    path, _ = tiny_checkpoints("mt_gemma4")
    cfg = maxtext_config("mt_gemma4", True, 1)
    abstract = mx.abstract_params(cfg, mesh)
    attention = abstract["decoder"]["scanned_blocks"]["global_layer"]["self_attention"]
    attention["value"] = attention["key"]
    with pytest.raises(ConfigError) as info:
        mx.load_state(str(path), abstract, cfg)
    assert "'gemma4'" in str(info.value) and "global_layer.self_attention.value" in str(info.value)


def test_an_unscanned_layer_of_the_other_kind_is_refused(tiny_checkpoints, mesh):
    """Layer 5 is global in MaxText's pattern: a value kernel there is a leaf no rule maps, and a
    tree without layer 11 is a layer short."""
    path, _ = tiny_checkpoints("mt_gemma4")
    cfg = maxtext_config("mt_gemma4", False, 1)
    abstract = mx.abstract_params(cfg, mesh)
    attention = abstract["decoder"]["layers_5"]["self_attention"]
    attention["value"] = abstract["decoder"]["layers_4"]["self_attention"]["value"]
    with pytest.raises(ConfigError) as info:
        mx.load_state(str(path), abstract, cfg)
    assert "decoder.layers_5.self_attention.value.kernel" in str(info.value)
    del attention["value"], abstract["decoder"]["layers_11"]
    with pytest.raises(ConfigError) as info:
        mx.load_state(str(path), abstract, cfg)
    assert info.value.field == "num_decoder_layers" and "should be 12 layers" in str(info.value)
    assert "..10;" in str(info.value)


# Gemma 4 E2B: 10 layers of MaxText's period 5, the last 5 sharing keys and values (double-wide MLPs there)
SMALL_LAYERS, SMALL_PERIOD, SHARED, PLE = 10, 5, 5, 8
FIRST_SHARED = SMALL_LAYERS - SHARED


def _gemma4_small():
    types = [F if i % SMALL_PERIOD == SMALL_PERIOD - 1 else S for i in range(SMALL_LAYERS)]
    return _gemma4(num_hidden_layers=SMALL_LAYERS, layer_types=types, attention_k_eq_v=False,
                   num_global_key_value_heads=None, num_kv_shared_layers=SHARED, hidden_size_per_layer_input=PLE,
                   vocab_size_per_layer_input=TEXT["vocab_size"], use_double_wide_mlp=True)


register_hf_model("mt_gemma4_small", _gemma4_small)


def small_config(**over) -> dict:
    cfg = maxtext_config("mt_gemma4", False, 1, model_name="gemma4-e2b", num_decoder_layers=SMALL_LAYERS,
                         hidden_size_per_layer_input=PLE, vocab_size_per_layer_input=TEXT["vocab_size"],
                         num_kv_shared_layers=SHARED, use_double_wide_mlp=True)
    return {**cfg, **over}


def small_expected(hf: dict, cfg: dict) -> dict:
    """E2B's MaxText leaves in numpy: MaxText's converter's (param_mapping.GEMMA4_SMALL_*) steps."""
    out = {"token_embedder.embedding": _pad(hf[f"{PREFIX}embed_tokens.weight"] * np.float32(np.sqrt(HIDDEN)), 0,
                                            cfg["vocab_size"]),
           "decoder.decoder_norm.scale": hf[f"{PREFIX}norm.weight"],
           "decoder.per_layer_embedder.embed_tokens_per_layer": hf[f"{PREFIX}embed_tokens_per_layer.weight"],
           "decoder.per_layer_embedder.per_layer_model_projection.kernel":
               hf[f"{PREFIX}per_layer_model_projection.weight"].T,
           "decoder.per_layer_embedder.per_layer_projection_norm.scale":
               hf[f"{PREFIX}per_layer_projection_norm.weight"]}
    for i in range(SMALL_LAYERS):
        p, mt = f"{PREFIX}layers.{i}", f"decoder.layers_{i}"
        a, hd = f"{p}.self_attn", GHD if i % SMALL_PERIOD == SMALL_PERIOD - 1 else HD
        leaves = {f"{m}.scale": hf[f"{p}.{name}.weight"] for m, name in (
            ("pre_self_attention_norm", "input_layernorm"), ("post_self_attention_norm", "post_attention_layernorm"),
            ("pre_ffw_norm", "pre_feedforward_layernorm"), ("post_ffw_norm", "post_feedforward_layernorm"),
            ("post_per_layer_input_norm", "post_per_layer_input_norm"))}
        leaves |= {"layer_scalar": hf[f"{p}.layer_scalar"],
                   "per_layer_input_gate.kernel": hf[f"{p}.per_layer_input_gate.weight"].T,
                   "per_layer_projection.kernel": hf[f"{p}.per_layer_projection.weight"].T,
                   "self_attention.query.kernel": _kernel(hf[f"{a}.q_proj.weight"], HIDDEN, HEADS, hd),
                   "self_attention.out.kernel": _kernel(hf[f"{a}.o_proj.weight"], HEADS, hd, HIDDEN),
                   "self_attention.query_norm.scale": hf[f"{a}.q_norm.weight"]}
        if i < FIRST_SHARED:  # the shared tail reads an earlier layer's keys and values
            leaves |= {"self_attention.key.kernel": _kernel(hf[f"{a}.k_proj.weight"], HIDDEN, KV, hd),
                       "self_attention.value.kernel": _kernel(hf[f"{a}.v_proj.weight"], HIDDEN, KV, hd),
                       "self_attention.key_norm.scale": hf[f"{a}.k_norm.weight"]}
        for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
            leaves[f"mlp.{leaf}.kernel"] = hf[f"{p}.mlp.{name}.weight"].T
        out |= {f"{mt}.{k}": v for k, v in leaves.items()}
    return out


def test_small_every_leaf_is_maxtexts_layout_and_exports_back(tiny_checkpoints, mesh, tmp_path):
    path, _ = tiny_checkpoints("mt_gemma4_small")
    cfg, original = small_config(vocab_size=320), hf_tensors(path)
    params = mx.load_state(str(path), abstract := mx.abstract_params(cfg, mesh), cfg)[1]["params"]
    want = small_expected(original, cfg)
    assert want["decoder.layers_9.mlp.wo.kernel"].shape == (2 * TEXT["intermediate_size"], HIDDEN)
    check(params, want, abstract)
    mx.export(params, tmp_path / "out", cfg, reference=path)
    written = hf_tensors(tmp_path / "out")
    assert sorted(written) == sorted(k for k in original if k.startswith(PREFIX))
    for key, value in written.items():
        if "embed_tokens." in key:
            np.testing.assert_allclose(value, original[key], rtol=2e-7, atol=0, err_msg=key)
        else:
            np.testing.assert_array_equal(value, original[key], err_msg=key)


def test_small_is_unscanned_only_and_reads_its_flag():
    with pytest.raises(ConfigError) as info:
        mx.select(small_config(scan_layers=True))
    assert info.value.field == "scan_layers" and "unscanned trees only" in str(info.value)
    with pytest.raises(ConfigError) as info:
        mx.select(small_config(use_double_wide_mlp=1))
    assert info.value.field == "use_double_wide_mlp"
    narrow = mx.abstract_params(small_config(use_double_wide_mlp=False))
    assert narrow["decoder"]["layers_9"]["mlp"]["wo"]["kernel"].shape == (TEXT["intermediate_size"], HIDDEN)
