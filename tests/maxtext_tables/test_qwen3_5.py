"""The Qwen3.5 MaxText table against numpy: every leaf of MaxText's tree in every layout, bitwise what
MaxText's converter (``param_mapping.QWEN3_5_*``) gives from a multimodal checkpoint's text model —
``in_proj_qkvz`` / ``in_proj_ba`` joined per key head from ``in_proj_qkv`` + ``in_proj_z`` and
``in_proj_b`` + ``in_proj_a`` (the converter's reshape-and-concatenate, written here in numpy), experts
stacked; scanned, ``layer_<j>`` stacks every fourth
layer at ``param_scan_axis``; export gives every text tensor back, bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, register_hf_model
from tests.maxtext_tables.support import DIMS, LAYOUTS, _kernel
from tests.maxtext_tables.test_export import round_trip
from tests.maxtext_tables.test_tables import check

LAYERS, PERIOD, EXPERTS, MOE_DIM = 8, 4, 4, 32
HK, DK, HV, DV = 2, 8, 4, 8
LIN, FULL = "linear_attention", "full_attention"
TEXT = dict(DIMS, num_hidden_layers=LAYERS, layer_types=[LIN, LIN, LIN, FULL] * (LAYERS // PERIOD),
            num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=MOE_DIM,
            shared_expert_intermediate_size=MOE_DIM, linear_num_key_heads=HK, linear_key_head_dim=DK,
            linear_num_value_heads=HV, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
            tie_word_embeddings=False)
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4)
M = "model.language_model"


def _qwen3_5_moe(**kw):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config={**TEXT, **kw}, vision_config=VISION,
                                                               tie_word_embeddings=False))


register_hf_model("mt_qwen3_5_moe", _qwen3_5_moe)


def maxtext_config(scan_layers: bool, param_scan_axis: int) -> dict:
    return dict(model_name="qwen3.5-35b-a3b", scan_layers=scan_layers, param_scan_axis=param_scan_axis,
                vocab_size=DIMS["vocab_size"], emb_dim=DIMS["hidden_size"], num_query_heads=8, num_kv_heads=4,
                head_dim=16, mlp_dim=MOE_DIM, moe_mlp_dim=MOE_DIM, num_experts=EXPERTS, num_decoder_layers=LAYERS,
                inhomogeneous_layer_cycle_interval=PERIOD, gdn_num_key_heads=HK, gdn_key_head_dim=DK,
                gdn_num_value_heads=HV, gdn_value_head_dim=DV, gdn_conv_kernel_dim=4, logits_via_embedding=False)


def per_key_head(*parts: np.ndarray) -> np.ndarray:
    """MaxText's converter: each part ``[key heads, rows per head, in]``, joined per head, transposed."""
    cols = parts[0].shape[-1]
    return np.concatenate([p.reshape(HK, -1, cols) for p in parts], axis=1).reshape(-1, cols).T


def layer(hf: dict, i: int) -> dict:
    """HF layer ``i``'s MaxText leaves."""
    p, m, h = f"{M}.layers.{i}", f"{M}.layers.{i}.mlp", DIMS["hidden_size"]
    out = {"input_layernorm.scale": hf[f"{p}.input_layernorm.weight"],
           "post_attention_layernorm.scale": hf[f"{p}.post_attention_layernorm.weight"],
           "mlp.routed_experts.gate.kernel": hf[f"{m}.gate.weight"].T,
           "mlp.shared_expert_gate.kernel": hf[f"{m}.shared_expert_gate.weight"].T}
    for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
        out[f"mlp.shared_expert.{leaf}.kernel"] = hf[f"{m}.shared_expert.{name}.weight"].T
        out[f"mlp.routed_experts.{leaf}"] = np.stack([hf[f"{m}.experts.{e}.{name}.weight"].T for e in range(EXPERTS)])
    if (i + 1) % PERIOD:  # Gated DeltaNet
        a = f"{p}.linear_attn"
        qkv = hf[f"{a}.in_proj_qkv.weight"]
        q, k, v = qkv[: HK * DK], qkv[HK * DK : 2 * HK * DK], qkv[2 * HK * DK :]
        out.update({"attention.in_proj_qkvz.kernel": per_key_head(q, k, v, hf[f"{a}.in_proj_z.weight"]),
                    "attention.in_proj_ba.kernel": per_key_head(hf[f"{a}.in_proj_b.weight"],
                                                                hf[f"{a}.in_proj_a.weight"]),
                    "attention.conv1d.kernel": hf[f"{a}.conv1d.weight"].transpose(2, 1, 0),
                    "attention.A_log": hf[f"{a}.A_log"], "attention.dt_bias": hf[f"{a}.dt_bias"],
                    "attention.norm.rms_norm.scale": hf[f"{a}.norm.weight"],
                    "attention.out_proj.kernel": hf[f"{a}.out_proj.weight"].T})
    else:
        a, x = f"{p}.self_attn", "attention.attention"
        out.update({f"{x}.query.kernel": _kernel(hf[f"{a}.q_proj.weight"], h, 8, 32),
                    f"{x}.key.kernel": _kernel(hf[f"{a}.k_proj.weight"], h, 4, 16),
                    f"{x}.value.kernel": _kernel(hf[f"{a}.v_proj.weight"], h, 4, 16),
                    f"{x}.out.kernel": hf[f"{a}.o_proj.weight"].T,
                    f"{x}.query_norm.scale": hf[f"{a}.q_norm.weight"], f"{x}.key_norm.scale": hf[f"{a}.k_norm.weight"]})
    return out


def expected(hf: dict, cfg: dict) -> dict:
    out = {"token_embedder.embedding": hf[f"{M}.embed_tokens.weight"], "decoder.decoder_norm.scale":
           hf[f"{M}.norm.weight"], "decoder.logits_dense.kernel": hf["lm_head.weight"].T}
    layers = [layer(hf, i) for i in range(LAYERS)]
    if not cfg["scan_layers"]:
        return {**out, **{f"decoder.layers_{i}.{k}": v for i, leaves in enumerate(layers) for k, v in leaves.items()}}
    for j in range(PERIOD):
        stack = layers[j::PERIOD]
        out.update({f"decoder.layers.layer_{j}.{k}": np.stack([x[k] for x in stack], cfg["param_scan_axis"])
                    for k in stack[0]})
    return out


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_every_leaf_is_maxtexts_layout_and_exports_back(tiny_checkpoints, mesh, tmp_path, scan, axis):
    path, _ = tiny_checkpoints("mt_qwen3_5_moe")
    cfg = maxtext_config(scan, axis)
    abstract = mx.abstract_params(cfg, mesh)
    check(mx.load_state(str(path), abstract, cfg)[1]["params"], expected(hf_tensors(path), cfg), abstract)
    written, original = round_trip(path, cfg, mesh, tmp_path / "out"), hf_tensors(path)
    text = {k: v for k, v in original.items() if not k.startswith("model.visual.")}
    assert sorted(written) == sorted(text)
    for key, value in text.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)
