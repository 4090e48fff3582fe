"""The OLMo 3 MaxText table against numpy: every leaf of MaxText's tree in every layout, bitwise what
MaxText's converter (``param_mapping.OLMO3_*``) gives — kernels ``[in, out]`` with heads split, the
post-norms and the whole-projection q/k norms as stored, scanned as four groups
``decoder.layers.layers_<j>`` of every fourth HF layer (8 layers: two each); export bit-exact; a
layer cycle other than 4 refused."""

from __future__ import annotations

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.errors import ConfigError
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, register_hf_model
from tests.maxtext_tables.support import DIMS, LAYOUTS, _kernel, cycled_layers
from tests.maxtext_tables.test_tables import check

LAYERS, CYCLE = 8, 4


def _olmo3(**kw):
    from transformers import Olmo3Config, Olmo3ForCausalLM

    return Olmo3ForCausalLM(Olmo3Config(**{**DIMS, "num_hidden_layers": LAYERS, **kw}))


register_hf_model("mt_olmo3", _olmo3)


def maxtext_config(scan_layers: bool, param_scan_axis: int, **over) -> dict:
    return {**dict(model_name="olmo3-7b", scan_layers=scan_layers, param_scan_axis=param_scan_axis,
                   vocab_size=DIMS["vocab_size"], emb_dim=DIMS["hidden_size"], num_query_heads=8, num_kv_heads=4,
                   head_dim=16, mlp_dim=DIMS["intermediate_size"], num_decoder_layers=LAYERS,
                   inhomogeneous_layer_cycle_interval=CYCLE, logits_via_embedding=False), **over}


def layer(hf: dict, i: int) -> dict:
    p, h = f"model.layers.{i}", DIMS["hidden_size"]
    out = {"post_self_attention_layer_norm.scale": hf[f"{p}.post_attention_layernorm.weight"],
           "post_mlp_layer_norm.scale": hf[f"{p}.post_feedforward_layernorm.weight"],
           "attention.query_norm.scale": hf[f"{p}.self_attn.q_norm.weight"],
           "attention.key_norm.scale": hf[f"{p}.self_attn.k_norm.weight"],
           "attention.query.kernel": _kernel(hf[f"{p}.self_attn.q_proj.weight"], h, 8, 16),
           "attention.key.kernel": _kernel(hf[f"{p}.self_attn.k_proj.weight"], h, 4, 16),
           "attention.value.kernel": _kernel(hf[f"{p}.self_attn.v_proj.weight"], h, 4, 16),
           "attention.out.kernel": _kernel(hf[f"{p}.self_attn.o_proj.weight"], 8, 16, h)}
    for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
        out[f"mlp.{leaf}.kernel"] = hf[f"{p}.mlp.{name}.weight"].T
    return out


def expected(hf: dict, cfg: dict) -> dict:
    out = {"token_embedder.embedding": hf["model.embed_tokens.weight"], "decoder.decoder_norm.scale":
           hf["model.norm.weight"], "decoder.logits_dense.kernel": hf["lm_head.weight"].T}
    return {**out, **cycled_layers([layer(hf, i) for i in range(LAYERS)], cfg, CYCLE, "layers_")}


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_every_leaf_is_maxtexts_layout_and_exports_back(tiny_checkpoints, mesh, tmp_path, scan, axis):
    path, _ = tiny_checkpoints("mt_olmo3")
    cfg = maxtext_config(scan, axis)
    abstract = mx.abstract_params(cfg, mesh)
    params = mx.load_state(str(path), abstract, cfg)[1]["params"]
    check(params, expected(hf_tensors(path), cfg), abstract)
    mx.export(params, tmp_path / "out", cfg, reference=path)
    written, original = hf_tensors(tmp_path / "out"), hf_tensors(path)
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)


def test_another_layer_cycle_is_refused(tiny_checkpoints, mesh):
    with pytest.raises(ConfigError) as info:
        mx.select(maxtext_config(True, 1, inhomogeneous_layer_cycle_interval=2))
    assert info.value.field == "inhomogeneous_layer_cycle_interval" and "'olmo3'" in str(info.value)
