"""Kimi-K2 / Kimi-K2.5: the DeepSeek-V3 architecture under ``kimi_k2``, and Kimi-K2.5's multimodal
wrapper (``kimi_k25``) whose language model sits under ``language_model.`` with an int4
compressed-tensors ``quantization_config`` nested in ``text_config``.

The published Kimi-K2.5 ``config.json`` is read from ``../shared/realconfigs`` (never copied): a tiny
``kimi_k25`` checkpoint keeps its wrapper, vision fields and quantization config verbatim and only
shrinks the text model's sizes to those of the tiny transformers DeepSeek-V3 model it is written
from; its routed experts are packed by compressed-tensors' own compressor. Parity is with
transformers' DeepSeek-V3 run on the dequantised weights.
"""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

import otfload
import tests.families.test_deepseek  # noqa: F401  (registers the tiny DeepSeek-V3 this module builds on)
from otfload.errors import UnsupportedModelError
from otfload.families.registry import family_for
from otfload.index.quant.view import quantization_method
from otfload.plan.sharding import make_mesh
from tests.families.checks import MESHES, reference_logits
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, rename_tensors, token_ids
from tests.index.quant import layouts

REALCONFIGS = Path(__file__).resolve().parents[3] / "shared" / "realconfigs"
KIMI_K25 = REALCONFIGS / "moonshotai__Kimi-K2.5.json"
VISION_KEY = "vision_tower.patch_embed.proj.weight"
pytestmark = pytest.mark.skipif(not KIMI_K25.is_file(), reason="../shared/realconfigs is not checked out")


def real_config() -> dict:
    return json.loads(KIMI_K25.read_text())


def is_routed_expert(key: str) -> bool:
    return ".mlp.experts." in key and key.endswith("proj.weight")


@pytest.fixture(scope="module")
def kimi_k25(tiny_checkpoints, tmp_path_factory):
    """``(dir, reference torch model)``: a tiny Kimi-K2.5 checkpoint and transformers' DeepSeek-V3 on
    its dequantised weights."""
    src, torch_model = tiny_checkpoints("deepseek_v3")
    real = real_config()
    qc = real["text_config"]["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    kind = "w4a16"  # the compressed-tensors scheme the published config names, written by its compressor
    assert {k: weights[k] for k in layouts.ct_weights(kind)} == layouts.ct_weights(kind)
    dst = tmp_path_factory.mktemp("kimi_k25") / "ckpt"
    reference = layouts.quantize_checkpoint(src, dst, is_routed_expert, layouts.compressed_tensors(kind), None)
    assert len(reference) == 2 * 4 * 3  # 2 MoE layers x 4 experts x gate/up/down
    reference_model = layouts.load_reference(torch_model, reference, src, dst.parent / "reference")
    rename_tensors(dst, lambda k: "language_model." + k, {VISION_KEY: np.ones((8, 3, 2, 2), np.float32)})
    tiny = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in real["text_config"].items() if k not in ("rope_scaling", "rope_theta")}
    text.update({k: v for k, v in tiny.items() if k not in ("model_type", "architectures", "auto_map")})
    config = {**real, "text_config": {**text, "quantization_config": qc}}
    (dst / "config.json").write_text(json.dumps(config))
    return dst, reference_model


@pytest.mark.parametrize(("scan_layers", "mesh_name"), [(True, "fsdp2_ep4"), (False, "fsdp2_tp4")])
def test_kimi_k25_text_model_matches_transformers_on_dequantised_experts(kimi_k25, scan_layers, mesh_name):
    path, reference_model = kimi_k25
    mesh = make_mesh(MESHES[mesh_name])
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype="float32",
                                            return_report=True)
    assert report.unused_tensors == [VISION_KEY]  # the vision tower: listed, never read
    ids = token_ids(seq=12)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(logits(model, ids), reference_logits(reference_model, ids))  # once for both
    assert diff <= 1e-4, diff


def test_kimi_k25_routed_experts_kept_packed(kimi_k25, mesh_2x4):
    from otfload.quantized import QuantizedArray

    path, _ = kimi_k25
    model = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32", quantized="keep")
    experts = model.moe_layers.moe.experts.gate.kernel[...]
    assert isinstance(experts, QuantizedArray) and experts.codes.dtype == np.int32
    assert not isinstance(model.moe_layers.moe.shared.gate.kernel[...], QuantizedArray)  # in 'ignore'


def test_the_published_kimi_configs_parse_as_deepseek_v3():
    real = real_config()
    family = family_for(real)
    cfg = family.parse_config(real)
    assert "kimi_k25" in family.name and cfg.model_type == "deepseek_v3"
    assert (cfg.num_hidden_layers, cfg.num_experts, cfg.mtp_layers, cfg.tie_word_embeddings) == (61, 384, 0, False)
    method, qc = quantization_method(real)  # nested in text_config
    assert method == "compressed-tensors" and qc["format"] == "pack-quantized"
    text = real["text_config"]
    assert family_for(text).parse_config(text) == cfg  # kimi_k2 on its own: the same model


def test_the_model_type_is_checked_before_quantized_tensors(tmp_path):
    """An unknown wrapper is refused for its model type, not for the int4 tensors it would explain."""
    config = {**real_config(), "model_type": "kimi_k3"}
    del config["text_config"]["quantization_config"]
    save_file({"language_model.model.layers.0.mlp.experts.0.up_proj.weight_packed": np.zeros((4, 1), np.int32),
               "language_model.model.layers.0.mlp.experts.0.up_proj.weight_scale": np.ones((4, 1), np.float32)},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="model_type 'kimi_k3' is not supported"):
        otfload.from_pretrained(tmp_path)


def test_a_wrong_text_config_field_is_named_under_text_config(kimi_k25, tmp_path):
    path, _ = kimi_k25
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["n_group"] = 3  # 4 experts do not split into 3 groups
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="text_config.n_group"):
        otfload.from_pretrained(bad)


def test_the_published_kimi_k25_plans_at_real_size(tmp_path):
    """A sparse replica of Kimi-K2.5 from its published config (scripts/make_replica.py: real names,
    dtypes and shapes, holes for the data): 207360 int4 expert tensors explained by the quantization
    config nested in text_config, the vision tower unused, ~594 GB planned from headers alone."""
    from tests.place.test_plan_scale import replica_module

    info = replica_module().make_replica("kimi-k2.5", tmp_path / "kimi", real_config())
    assert info["tensors"] == 208217
    mesh = make_mesh({"fsdp": 2, "ep": 4})
    _, plan, src = otfload.plan_model(tmp_path / "kimi", mesh=mesh, scan_layers=True)
    src.close()
    assert plan.unused == ["mm_projector.proj.0.weight", "vision_tower.patch_embed.proj.weight"]
    experts = plan.leaves["moe_layers.moe.experts.up.kernel"]
    assert experts.storage == "compressed-tensors int4 packed, group" and len(experts.sources) == 60 * 384
    assert plan.leaves["moe_layers.moe.shared.up.kernel"].storage == "bfloat16"  # in 'ignore'
    assert 590e9 < plan.source_bytes < 600e9
