"""The Qwen3.5 MaxText tables against numpy: every leaf of MaxText's tree in every layout, bitwise what
MaxText's converter (``param_mapping.QWEN3_5_*``) gives from a multimodal checkpoint's text model —
``in_proj_qkvz`` / ``in_proj_ba`` joined per key head from ``in_proj_qkv`` + ``in_proj_z`` and
``in_proj_b`` + ``in_proj_a`` (the converter's reshape-and-concatenate, written here in numpy), experts
stacked (every other leaf as Qwen3-Next's: ``test_qwen3_next.layer``); scanned, ``layer_<j>`` stacks every fourth
layer at ``param_scan_axis``. The bfloat16 releases' experts are fused (``mlp.experts.gate_up_proj`` /
``down_proj``: the checkpoint transformers saves, fused as ``make_refs.fuse_experts`` does; the expected
leaves from the unfused one); export gives every text tensor back, bit-exact. The FP8 releases
(``qwen3.5-35b-a3b-fp8``) store experts one per tensor and every projection block-scaled FP8, the joins'
parts too: each is decoded as it is read, equal to numpy's dequantisation of the stored codes."""

from __future__ import annotations

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, register_hf_model
from tests.index.quant import layouts
from tests.maxtext.make_refs import fused_copy
from tests.maxtext_tables.support import DIMS, LAYOUTS, cycled_layers
from tests.maxtext_tables.test_export import round_trip
from tests.maxtext_tables.test_qwen3_next import EXPERTS, LAYERS, PERIOD, layer
from tests.maxtext_tables.test_tables import check

MOE_DIM = 32
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


def maxtext_config(scan_layers: bool, param_scan_axis: int, model_name: str = "qwen3.5-35b-a3b") -> dict:
    return dict(model_name=model_name, scan_layers=scan_layers, param_scan_axis=param_scan_axis,
                vocab_size=DIMS["vocab_size"], emb_dim=DIMS["hidden_size"], num_query_heads=8, num_kv_heads=4,
                head_dim=16, mlp_dim=MOE_DIM, moe_mlp_dim=MOE_DIM, num_experts=EXPERTS, num_decoder_layers=LAYERS,
                inhomogeneous_layer_cycle_interval=PERIOD, gdn_num_key_heads=HK, gdn_key_head_dim=DK,
                gdn_num_value_heads=HV, gdn_value_head_dim=DV, gdn_conv_kernel_dim=4, logits_via_embedding=False)


def per_key_head(*parts: np.ndarray) -> np.ndarray:
    """MaxText's converter: each part ``[key heads, rows per head, in]``, joined per head, transposed."""
    cols = parts[0].shape[-1]
    return np.concatenate([p.reshape(HK, -1, cols) for p in parts], axis=1).reshape(-1, cols).T


def as_qwen3_next(hf: dict) -> dict:
    """The checkpoint as Qwen3-Next's would hold it: the text model's keys under ``model.``, and each
    linear layer's ``in_proj_qkvz`` / ``in_proj_ba`` as MaxText's converter joins them (before its transpose)."""
    out = {k.replace(f"{M}.", "model.", 1): v for k, v in hf.items() if not k.startswith("model.visual.")}
    for i in range(LAYERS):
        a = f"model.layers.{i}.linear_attn"
        if f"{a}.in_proj_qkv.weight" in out:
            qkv = out.pop(f"{a}.in_proj_qkv.weight")
            q, k, v = qkv[: HK * DK], qkv[HK * DK : 2 * HK * DK], qkv[2 * HK * DK :]
            out[f"{a}.in_proj_qkvz.weight"] = per_key_head(q, k, v, out.pop(f"{a}.in_proj_z.weight")).T
            out[f"{a}.in_proj_ba.weight"] = per_key_head(out.pop(f"{a}.in_proj_b.weight"),
                                                         out.pop(f"{a}.in_proj_a.weight")).T
    return out


def expected(hf: dict, cfg: dict) -> dict:
    hf = as_qwen3_next(hf)
    out = {"token_embedder.embedding": hf["model.embed_tokens.weight"], "decoder.decoder_norm.scale":
           hf["model.norm.weight"], "decoder.logits_dense.kernel": hf["lm_head.weight"].T}
    return {**out, **cycled_layers([layer(hf, i) for i in range(LAYERS)], cfg, PERIOD, "layer_")}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


@pytest.fixture(scope="module")
def fused(tiny_checkpoints, tmp_path_factory):
    """The tiny checkpoint as the bfloat16 releases store it (experts fused), and the one saved (per expert)."""
    path, _ = tiny_checkpoints("mt_qwen3_5_moe")
    return fused_copy(path, tmp_path_factory.mktemp("qwen3_5") / "fused"), path


# the FP8 releases' block-scaled projections (Qwen's quantization_config), 16 x 16 blocks here: a key head's
# 8 q / k rows are half a block, so the joins read part blocks
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16],
              "modules_to_not_convert": ["lm_head", "linear_attn.in_proj_a", "linear_attn.in_proj_b", "mlp.gate"]}


def _fp8_projection(key: str) -> bool:
    return not key.startswith("model.visual.") and (layouts.is_linear(key) or key.endswith(
        ("in_proj_qkv.weight", "in_proj_z.weight")))


@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_every_leaf_is_maxtexts_layout_and_exports_back(fused, mesh, tmp_path, scan, axis):
    path, saved = fused
    cfg = maxtext_config(scan, axis)
    abstract = mx.abstract_params(cfg, mesh)
    check(mx.load_state(str(path), abstract, cfg)[1]["params"], expected(hf_tensors(saved), cfg), abstract)
    written, original = round_trip(path, cfg, mesh, tmp_path / "out"), hf_tensors(path)
    text = {k: v for k, v in original.items() if not k.startswith("model.visual.")}
    assert sorted(written) == sorted(text)
    for key, value in text.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)


@pytest.mark.parametrize(("scan", "axis"), [(True, 1), (False, 0)])
def test_fp8_release_decodes_every_part(tiny_checkpoints, mesh, tmp_path, scan, axis):
    """``qwen3.5-35b-a3b-fp8``: per-expert experts, FP8 projections (``in_proj_qkvz``'s two parts among
    them) decoded as they are read; every leaf equal to the table's layout of numpy's dequantised tensors."""
    path, _ = tiny_checkpoints("mt_qwen3_5_moe")
    dequantised = layouts.quantize_checkpoint(path, tmp_path / "fp8", _fp8_projection, layouts.fp8_blocks((16, 16)),
                                              FP8_CONFIG)
    assert any(k.endswith("in_proj_qkv.weight") for k in dequantised) and any(
        k.endswith("in_proj_z.weight") for k in dequantised)
    cfg = maxtext_config(scan, axis, "qwen3.5-35b-a3b-fp8")
    abstract = mx.abstract_params(cfg, mesh)
    check(mx.load_state(str(tmp_path / "fp8"), abstract, cfg)[1]["params"],
          expected({**hf_tensors(path), **dequantised}, cfg), abstract)
