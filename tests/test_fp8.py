"""FP8 block-scaled checkpoints (DeepSeek-V3 format) dequantised on the fly."""

import copy
import json
import shutil

import jax.numpy as jnp
import numpy as np
import torch
from safetensors.numpy import load_file, save_file

import otfload
from tests.helpers import max_rel_diff, token_ids, torch_logits
from tests.read.test_dequant import quantize_blocks, reference_dequant

BLOCK = (48, 48)  # several blocks per matrix, including partial ones at the edges


def make_fp8_checkpoint(src, dst):
    """Quantise every 2-D projection of a bf16 checkpoint; returns {key: dequantised f32 weight}."""
    shutil.copytree(src, dst)
    dequantised = {}
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for f in sorted(dst.glob("*.safetensors")):
        tensors = load_file(f)
        for key in list(tensors):
            if key.endswith("proj.weight"):
                q, scales = quantize_blocks(tensors[key].astype(np.float32), BLOCK)
                tensors[key], tensors[f"{key}_scale_inv"] = q, scales
                index["weight_map"][f"{key}_scale_inv"] = f.name
                dequantised[key] = reference_dequant(q, scales, BLOCK)
        save_file(tensors, f, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(config))
    return dequantised


def test_fp8_checkpoint_dequantises_per_shard(tiny_checkpoints, mesh_2x4, tmp_path):
    src, torch_model = tiny_checkpoints("llama_bf16")
    dequantised = make_fp8_checkpoint(src, tmp_path / "fp8")
    model, report = otfload.from_pretrained(tmp_path / "fp8", mesh=mesh_2x4, dtype="float32", return_report=True)
    assert report.unused_tensors == []  # the scales are used, not left over
    got = np.asarray(model.layers.mlp.down.kernel[...])
    want = np.stack([dequantised[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(3)])
    np.testing.assert_array_equal(got, want)

    # Logits equal transformers' run on the same dequantised weights (f32 parity)...
    reference = type(torch_model)(torch_model.config).float().eval()
    state = {k: torch.tensor(v) for k, v in dequantised.items()}
    for f in src.glob("*.safetensors"):
        for k, v in load_file(f).items():
            state.setdefault(k, torch.tensor(v.astype(np.float32)))
    reference.load_state_dict(state, strict=False)
    ids = token_ids()
    ours = np.asarray(model(jnp.asarray(ids)))
    assert max_rel_diff(ours, torch_logits(reference, ids)) <= 1e-4
    # ...and stay close to the unquantised bf16 model: e4m3 keeps 3 mantissa bits (≤ 6.25 % per
    # weight, ~2 % rms); over 3 layers of random weights the logits drift well under 15 %.
    assert max_rel_diff(ours, torch_logits(copy.deepcopy(torch_model).float(), ids)) <= 0.15


def test_fp8_default_dtype_is_bf16(tiny_checkpoints, tmp_path):
    src, _ = tiny_checkpoints("llama_bf16")
    make_fp8_checkpoint(src, tmp_path / "fp8")
    model = otfload.from_pretrained(tmp_path / "fp8")
    assert model.layers.attn.q.kernel[...].dtype == jnp.bfloat16
