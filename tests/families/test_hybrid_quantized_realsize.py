"""The published hybrid configs at full size in their quantized layouts, headers only (tests/realsize.py):
Qwen3.5-27B and Qwen3.5-35B-A3B as Qwen's FP8 releases store them (e4m3 codes, float32 128x128
``weight_scale_inv``, the ``quantization_config`` added as those releases write it) and
Nemotron-3-Nano-30B-A3B as NVIDIA's ModelOpt NVFP4 and FP8 releases store it (``hf_quant_config.json``,
the attention layers and the Mamba layers feeding them bf16). ``otfload inspect --devices 256`` for process
0 of 32: every leaf planned within 10 s of the child's CPU and 1 GiB of its own peak, one process's
bytes (held and fetched) within 1.1x its devices' share of the stored bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otfload.families.nemotron_h import NemotronHConfig
from tests.families.test_hybrid_quantized import QWEN_KEPT, qwen_quantized
from tests.families.test_nemotron_h import NANO, nano_headers
from tests.families.test_qwen3_5 import DENSE_27B, MOE_35B, _replica_tensors
from tests.realsize import Spec, fp8_linear, inspect_at_scale, write_header_checkpoint

FP8_BLOCK = [128, 128]


def qwen_fp8_headers(path: Path, published: Path) -> tuple[Path, int]:
    """A published Qwen3.5 config as its FP8 release stores it (the config's ``quantization_config`` as
    Qwen writes it), headers only, two files; ``(path, its stored bytes)``."""
    real = json.loads(published.read_text())
    layers = real["text_config"]["num_hidden_layers"]
    prefix = "model.language_model.layers"
    kept = [f"{prefix}.{i}.{m}" for i in range(layers) for m in QWEN_KEPT]
    config = {**real, "quantization_config": {"activation_scheme": "dynamic", "quant_method": "fp8",
                                              "weight_block_size": FP8_BLOCK,
                                              "modules_to_not_convert": ["lm_head", "model.visual", "mtp", *kept]}}
    tensors: dict[str, Spec] = {}
    for name, dtype, shape in _replica_tensors(real["text_config"]):
        quantized = qwen_quantized(name) and not name.startswith("mtp.")
        tensors |= fp8_linear(name, *shape) if quantized else {name: (dtype, shape)}
    names = list(tensors)
    half = len(names) // 2
    shards = {f"model-0000{k + 1}-of-00002.safetensors": {n: tensors[n] for n in part}
              for k, part in enumerate((names[:half], names[half:]))}
    return write_header_checkpoint(path, shards, config), _stored_bytes(tensors)


def _stored_bytes(tensors: dict[str, Spec]) -> int:
    from math import prod

    from tests.realsize import ITEMSIZE

    return sum(prod(shape) * ITEMSIZE[dtype] for dtype, shape in tensors.values())


def assert_plans_at_scale(path: Path, mesh: str, model_type: str, check_cpu: bool = True) -> dict:
    """The plan's checks at 256 devices; its CPU seconds in ``leaves[""]["cpu_seconds"]`` (asserted
    <= 10 here unless ``check_cpu`` is False: the caller then judges them after its own checks)."""
    cpu, peak, info = inspect_at_scale(path, mesh)
    assert (cpu <= 10 or not check_cpu) and peak <= 2**30, (cpu, peak)
    info["cpu_seconds"] = cpu
    assert info["model_type"] == model_type
    totals = info["totals"]
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)
    return {leaf["leaf"]: leaf for leaf in info["leaves"]} | {"": info}


@pytest.mark.skipif(not DENSE_27B.is_file(), reason="../shared/realconfigs is not checked out")
def test_qwen3_5_27b_fp8_plans_at_256_devices(tmp_path):
    path, stored = qwen_fp8_headers(tmp_path / "27b", DENSE_27B)
    leaves = assert_plans_at_scale(path, "fsdp=32,tp=8", "qwen3_5")
    info = leaves[""]
    assert sorted(info["unused"]) == ["model.visual.blocks.0.mlp.linear_fc1.weight", "mtp.fc.weight"]
    qkv = leaves["linear_layers.linear_attn.qkv.kernel"]
    assert qkv["shape"] == [48, 10240, 5120] and "fp8" in qkv["storage"], qkv
    assert "fp8" in leaves["attention_layers.attn.q.kernel"]["storage"]
    assert "fp8" not in leaves["linear_layers.linear_attn.a.kernel"]["storage"]
    used = stored - (4304 * 1152 + 5120 * 10240) * 2  # less the two unused tensors
    assert info["totals"]["source_bytes"] == used and 27e9 < used < 32e9, (info["totals"], used)


@pytest.mark.skipif(not MOE_35B.is_file(), reason="../shared/realconfigs is not checked out")
def test_qwen3_5_35b_a3b_fp8_plans_at_256_devices(tmp_path):
    path, stored = qwen_fp8_headers(tmp_path / "35b", MOE_35B)
    leaves = assert_plans_at_scale(path, "fsdp=32,ep=8", "qwen3_5_moe")
    experts = leaves["linear_layers.moe.gate.kernel"]
    assert experts["shape"] == [30, 256, 512, 2048] and "fp8" in experts["storage"], experts
    assert "fp8" not in leaves["attention_layers.shared_gate.kernel"]["storage"]
    assert 33e9 < leaves[""]["totals"]["source_bytes"] < 40e9, leaves[""]["totals"]


def nano_modelopt(cfg: NemotronHConfig, algo: str):
    """``store`` of NVIDIA's ModelOpt release in ``algo``: NVFP4 (U8 codes, F8 scales per 16, F32
    ``weight_scale_2``) or FP8 (e4m3 codes, one F32 ``weight_scale``), with an F32 ``input_scale``, for
    every linear but ``lm_head``, the attention layers and the Mamba layer before each; FP8 KV scales on
    the attention layers; and the list of those modules."""
    kinds = cfg.layers_block_type
    feeding = {max(j for j in range(i) if kinds[j] == "linear_attention") for i in cfg.attention_layers}
    kept = ["lm_head", *(f"backbone.layers.{i}.mixer.{p}_proj" for i in cfg.attention_layers for p in "qkvo"),
            *(f"backbone.layers.{i}.mixer.{p}_proj" for i in sorted(feeding) for p in ("in", "out"))]

    def store(key: str, spec: Spec) -> dict[str, Spec]:
        module = key.removesuffix(".weight")
        if module in kept or not key.endswith("proj.weight"):
            kv = module[-6] if module.endswith(("k_proj", "v_proj")) else None  # the FP8 KV cache's scale
            return {key: spec, **({f"{module}.{kv}_scale": ("F32", ())} if kv else {})}
        out, inp = spec[1]
        if algo == "FP8":
            return {key: ("F8_E4M3", (out, inp)), f"{key}_scale": ("F32", ()), f"{module}.input_scale": ("F32", ())}
        return {key: ("U8", (out, inp // 2)), f"{key}_scale": ("F8_E4M3", (out, inp // 16)),
                f"{key}_scale_2": ("F32", ()), f"{module}.input_scale": ("F32", ())}

    return store, kept


@pytest.mark.skipif(not NANO.is_file(), reason="../shared/realconfigs is not checked out")
@pytest.mark.parametrize(("algo", "storage", "gib"), [("NVFP4", "nvfp4", (17, 24)), ("FP8", "modelopt fp8", (30, 36))])
def test_nemotron_3_nano_modelopt_plans_at_256_devices(tmp_path, algo, storage, gib):
    cfg = NemotronHConfig.from_hf(json.loads(NANO.read_text()))
    store, kept = nano_modelopt(cfg, algo)
    path = nano_headers(tmp_path / "nano", store)
    (path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": algo, "kv_cache_quant_algo": "FP8", "group_size": 16,
                         "exclude_modules": kept}}))
    leaves = assert_plans_at_scale(path, "fsdp=32,tp=8", "nemotron_h")
    assert leaves[""]["unused"] == []
    experts = leaves["moe_layers.mixer.experts.up.kernel"]
    assert experts["shape"] == [23, 128, 1856, 2688] and storage in experts["storage"].lower(), experts
    assert leaves["attention_layers.mixer.q.kernel"]["storage"] == "bfloat16"
    assert gib[0] * 1e9 < leaves[""]["totals"]["source_bytes"] < gib[1] * 1e9, leaves[""]["totals"]
