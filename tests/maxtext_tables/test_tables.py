"""Each MaxText table against numpy: every leaf of MaxText's tree, for every layout (scanned at
``param_scan_axis`` 1 and 0, unscanned), bitwise the layout MaxText's converter gives, with the
tree's dtype and sharding; the vocabulary padded with zeros; a bfloat16 checkpoint into float32."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors
from tests.maxtext_tables.support import LAYOUTS, MODELS, expected, maxtext_config


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


def flat(tree) -> dict:
    return {".".join(str(k.key) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def check(loaded: dict, want: dict, abstract: dict) -> None:
    got, spec = flat(loaded), flat(abstract)
    assert sorted(got) == sorted(want)
    for path, value in want.items():
        array = got[path]
        assert array.shape == spec[path].shape and array.dtype == spec[path].dtype, path
        assert array.sharding == spec[path].sharding, path
        np.testing.assert_array_equal(np.asarray(array), value.astype(spec[path].dtype), err_msg=path)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_every_leaf_is_maxtexts_layout(tiny_checkpoints, mesh, kind, scan, axis):
    path, _ = tiny_checkpoints(kind)
    cfg = maxtext_config(kind, scan, axis)
    abstract = mx.abstract_params(cfg, mesh)
    none, restored = mx.load_state(str(path), abstract, cfg)
    assert none is None and set(restored) == {"params"}
    check(restored["params"], expected(kind, hf_tensors(path), cfg), abstract)


def test_vocabulary_padded_with_zeros(tiny_checkpoints, mesh):
    path, _ = tiny_checkpoints("mt_llama")
    cfg = maxtext_config("mt_llama", True, 1, vocab_size=320)
    abstract = mx.abstract_params(cfg, mesh)
    params = mx.load_state(str(path), abstract, cfg)[1]["params"]
    want = expected("mt_llama", hf_tensors(path), cfg)
    check(params, want, abstract)
    assert not np.asarray(params["token_embedder"]["embedding"])[256:].any()


def test_bf16_checkpoint_into_float32_tree(tiny_checkpoints, mesh):
    path, _ = tiny_checkpoints("mt_llama_bf16")
    cfg = maxtext_config("mt_llama_bf16", True, 1, head_dim=32)
    abstract = mx.abstract_params(cfg, mesh)
    params = mx.load_state(str(path), abstract, cfg)[1]["params"]
    check(params, expected("mt_llama", hf_tensors(path), cfg), abstract)


def test_nnx_state_and_linen_params_are_taken_as_maxtext_takes_them(tiny_checkpoints, mesh):
    from flax import nnx

    path, _ = tiny_checkpoints("mt_qwen3")
    cfg = maxtext_config("mt_qwen3", False, 1)
    abstract = mx.abstract_params(cfg, mesh)
    want = expected("mt_qwen3", hf_tensors(path), cfg)
    check(mx.load_state(str(path), nnx.State(abstract), cfg)[1]["params"], want, abstract)
    check(mx.load_state(str(path), {"params": abstract}, cfg)[1]["params"], want, abstract)


def test_instruct_suffix_reads_the_base_table():
    cfg = maxtext_config("mt_llama", True, 1, model_name="llama3.1-8b-Instruct")
    assert mx.select(cfg).table.name == "llama3.1"


def test_gpt_oss_mxfp4_experts_load_as_transformers_dequantises_them(tiny_checkpoints, mesh, tmp_path):
    """GPT-OSS as published: experts in MXFP4 (``*_blocks`` / ``*_scales``), decoded by otfload's index
    into MaxText's ``wi_0`` / ``wi_1`` / ``wo``, equal to transformers' dequantisation of the same bytes."""
    from tests.index.quant import layouts

    src, _ = tiny_checkpoints("mt_gpt_oss")
    path = tmp_path / "mxfp4"
    dequantised = layouts.quantize_checkpoint(src, path, layouts.is_gpt_oss_expert, layouts.mxfp4_experts,
                                              layouts.MXFP4_CONFIG)
    cfg = maxtext_config("mt_gpt_oss", True, 1)
    abstract = mx.abstract_params(cfg, mesh)
    params = mx.load_state(str(path), abstract, cfg)[1]["params"]
    check(params, expected("mt_gpt_oss", {**hf_tensors(path), **dequantised}, cfg), abstract)


@pytest.mark.parametrize(("scan", "axis"), [(True, 1), (False, 1)])
def test_deepseek3_multi_token_prediction_layer(tiny_checkpoints, mesh, tmp_path, scan, axis):
    """``mtp_num_layers: 1``: the checkpoint's layer ``num_hidden_layers`` as ``mtp_block.mtp_layer_1``,
    unstacked in either layout; without it the same checkpoint loads the tree without ``mtp_block``."""
    import shutil

    from tests.maxtext_tables.grouped import add_mtp_layer

    src, _ = tiny_checkpoints("mt_deepseek3")
    path = tmp_path / "mtp"
    shutil.copytree(src, path)
    add_mtp_layer(path, 3)
    cfg = maxtext_config("mt_deepseek3", scan, axis, mtp_num_layers=1)
    abstract = mx.abstract_params(cfg, mesh)
    assert "mtp_block" in abstract
    check(mx.load_state(str(path), abstract, cfg)[1]["params"], expected("mt_deepseek3", hf_tensors(path), cfg),
          abstract)
    plain = maxtext_config("mt_deepseek3", scan, axis)  # the Hub's V3 always stores the layer; MaxText's default
    abstract = mx.abstract_params(plain, mesh)
    check(mx.load_state(str(path), abstract, plain)[1]["params"], expected("mt_deepseek3", hf_tensors(path), plain),
          abstract)


def test_deepseek3_fp8_checkpoint_loads_as_its_dequantisation(tiny_checkpoints, mesh, tmp_path):
    """DeepSeek-V3 as published: every projection FP8 e4m3 with block scales (``weight_scale_inv``;
    16 x 16 blocks here, 128 x 128 there), decoded by otfload's index into MaxText's float32 tree."""
    from tests.index.quant import layouts

    src, _ = tiny_checkpoints("mt_deepseek3")
    path = tmp_path / "fp8"
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    dequantised = layouts.quantize_checkpoint(src, path, layouts.is_linear, layouts.fp8_blocks((16, 16)), config)
    assert any(".experts." in key for key in dequantised) and any("kv_b_proj" in key for key in dequantised)
    cfg = maxtext_config("mt_deepseek3", True, 1)
    abstract = mx.abstract_params(cfg, mesh)
    params = mx.load_state(str(path), abstract, cfg)[1]["params"]
    # the other tensors are copied as they are (numpy's safetensors reads no FP8: from the source)
    check(params, expected("mt_deepseek3", {**hf_tensors(src), **dequantised}, cfg), abstract)
