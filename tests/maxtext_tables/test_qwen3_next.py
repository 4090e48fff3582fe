"""The Qwen3-Next MaxText table against numpy: every leaf of MaxText's tree in every layout, bitwise
what MaxText's converter (``param_mapping.QWEN3_NEXT_*``) gives — kernels ``[in, out]`` (the full
attention's q/k/v with heads split, the query ``[embed, heads, 2 * head_dim]``), ``conv1d``
``[kernel, 1, channels]``, the rest as stored; scanned, ``local_layers`` stacks the three linear
layers of each block of four twice (``[blocks, 3]`` at ``param_scan_axis`` and the next dimension),
``global_layer`` every fourth; unscanned layers hold their kind's leaves only; export bit-exact."""

from __future__ import annotations

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.errors import ConfigError
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, register_hf_model
from tests.maxtext_tables.support import DIMS, LAYOUTS, _kernel
from tests.maxtext_tables.test_export import round_trip
from tests.maxtext_tables.test_tables import check

LAYERS, PERIOD, EXPERTS = 8, 4, 4
GDN = dict(linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4, linear_value_head_dim=8,
           linear_conv_kernel_dim=4)


def _qwen3_next(**kw):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(**{**DIMS, "num_hidden_layers": LAYERS, "num_experts": EXPERTS,
                                                   "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                   "shared_expert_intermediate_size": 32, **GDN, **kw}))


register_hf_model("mt_qwen3_next", _qwen3_next)


def maxtext_config(scan_layers: bool, param_scan_axis: int, **over) -> dict:
    return {**dict(model_name="qwen3-next-80b-a3b", scan_layers=scan_layers, param_scan_axis=param_scan_axis,
                   vocab_size=DIMS["vocab_size"], emb_dim=DIMS["hidden_size"], num_query_heads=8, num_kv_heads=4,
                   head_dim=16, mlp_dim=32, moe_mlp_dim=32, num_experts=EXPERTS, num_decoder_layers=LAYERS,
                   inhomogeneous_layer_cycle_interval=PERIOD, gdn_num_key_heads=2, gdn_key_head_dim=8,
                   gdn_num_value_heads=4, gdn_value_head_dim=8, gdn_conv_kernel_dim=4, logits_via_embedding=False),
            **over}


def layer(hf: dict, i: int) -> dict:
    """HF layer ``i``'s MaxText leaves (experts stacked first)."""
    p, m, h = f"model.layers.{i}", f"model.layers.{i}.mlp", DIMS["hidden_size"]
    out = {"input_layernorm.scale": hf[f"{p}.input_layernorm.weight"],
           "post_attention_layernorm.scale": hf[f"{p}.post_attention_layernorm.weight"],
           "mlp.routed_experts.gate.kernel": hf[f"{m}.gate.weight"].T,
           "mlp.shared_expert_gate.kernel": hf[f"{m}.shared_expert_gate.weight"].T}
    for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
        out[f"mlp.shared_expert.{leaf}.kernel"] = hf[f"{m}.shared_expert.{name}.weight"].T
        out[f"mlp.routed_experts.{leaf}"] = np.stack([hf[f"{m}.experts.{e}.{name}.weight"].T for e in range(EXPERTS)])
    if (i + 1) % PERIOD:  # Gated DeltaNet
        a = f"{p}.linear_attn"
        out.update({"attention.in_proj_qkvz.kernel": hf[f"{a}.in_proj_qkvz.weight"].T,
                    "attention.in_proj_ba.kernel": hf[f"{a}.in_proj_ba.weight"].T,
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
    out = {"token_embedder.embedding": hf["model.embed_tokens.weight"], "decoder.decoder_norm.scale":
           hf["model.norm.weight"], "decoder.logits_dense.kernel": hf["lm_head.weight"].T}
    layers = [layer(hf, i) for i in range(LAYERS)]
    if not cfg["scan_layers"]:
        return {**out, **{f"decoder.layers_{i}.{k}": v for i, leaves in enumerate(layers) for k, v in leaves.items()}}
    axis, blocks = cfg["param_scan_axis"], range(LAYERS // PERIOD)
    glob = [layers[b * PERIOD + PERIOD - 1] for b in blocks]
    out.update({f"decoder.layers.global_layer.{k}": np.stack([x[k] for x in glob], axis) for k in glob[0]})
    local = [[layers[b * PERIOD + j] for j in range(PERIOD - 1)] for b in blocks]
    for k in local[0][0]:  # [blocks, local] at param_scan_axis and the next one: the positions, then the blocks
        out[f"decoder.layers.local_layers.{k}"] = np.stack([np.stack([x[k] for x in row], axis) for row in local], axis)
    return out


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_every_leaf_is_maxtexts_layout_and_exports_back(tiny_checkpoints, mesh, tmp_path, scan, axis):
    path, _ = tiny_checkpoints("mt_qwen3_next")
    cfg = maxtext_config(scan, axis)
    abstract = mx.abstract_params(cfg, mesh)
    check(mx.load_state(str(path), abstract, cfg)[1]["params"], expected(hf_tensors(path), cfg), abstract)
    written, original = round_trip(path, cfg, mesh, tmp_path / "out"), hf_tensors(path)
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value, err_msg=key)


def test_another_layer_cycle_is_refused():
    with pytest.raises(ConfigError) as info:
        mx.select(maxtext_config(True, 1, inhomogeneous_layer_cycle_interval=2))
    assert info.value.field == "inhomogeneous_layer_cycle_interval" and "'qwen3_next'" in str(info.value)


def test_an_unscanned_tree_without_a_full_attention_layer_is_refused(tiny_checkpoints, mesh):
    """Layer 7's attention leaves missing (a tree of another layer pattern): refused before a read."""
    path, _ = tiny_checkpoints("mt_qwen3_next")
    cfg = maxtext_config(False, 1)
    abstract = mx.abstract_params(cfg, mesh)
    del abstract["decoder"]["layers_7"]["attention"]
    with pytest.raises(ConfigError) as info:
        mx.load_state(str(path), abstract, cfg)
    assert info.value.field == "num_decoder_layers" and "'qwen3_next'" in str(info.value)
