"""Round trip HF → otfload → HF: bit-exact tensors, the same keys and index as ``save_pretrained``,
transformers loads the export, sharding does not change it, writes are atomic."""

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

import otfload
from otfload.errors import MappingError, OutputExistsError
from otfload.export import export_checkpoint, export_hf, writer
from otfload.plan.sharding import make_mesh
from tests.helpers import max_rel_diff, token_ids, torch_logits

NAMES = ["llama", "llama_tied", "llama_bf16", "qwen2", "qwen3"]


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(safetensors.numpy.load_file(file))
    return tensors


def weight_map_keys(path: Path) -> list[str]:
    return sorted(json.loads((path / "model.safetensors.index.json").read_text())["weight_map"])


def assert_bit_exact(ours: dict, ref: dict) -> None:
    assert sorted(ours) == sorted(ref)
    for key, value in ref.items():
        assert ours[key].dtype == value.dtype and ours[key].shape == value.shape, key
        assert np.array_equal(ours[key].view(np.uint8), value.view(np.uint8)), key


@pytest.fixture(scope="module")
def single_mesh():
    return make_mesh({"fsdp": 1}, devices=jax.devices()[:1])


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("name", NAMES)
def test_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, name, scan):
    src, _ = tiny_checkpoints(name)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan)
    out = export_hf(model, tmp_path / "out", reference=src, max_shard_size="60KB")
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert weight_map_keys(out) == weight_map_keys(src)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in read_tensors(src).values())
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen3"])
def test_transformers_loads_the_export_with_matching_logits(tiny_checkpoints, mesh_2x4, tmp_path, name):
    from transformers import AutoModelForCausalLM

    src, _ = tiny_checkpoints(name)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=True)
    out = export_hf(model, tmp_path / "out", config=src / "config.json")  # shapes inferred, no reference
    ids = token_ids()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert max_rel_diff(np.asarray(model(ids)), torch_logits(reloaded, ids)) <= 1e-4


def test_sharded_export_equals_single_device_export(tiny_checkpoints, mesh_2x4, single_mesh, tmp_path):
    src, _ = tiny_checkpoints("qwen2")
    sharded = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=True)
    single = otfload.from_pretrained(src, mesh=single_mesh, scan_layers=True)
    assert len(sharded.layers.attn.q.kernel.get_value().addressable_shards) == 8
    a = export_hf(sharded, tmp_path / "sharded", reference=src)
    b = export_hf(single, tmp_path / "single", reference=src)
    names = sorted(p.name for p in a.iterdir())
    expected = ["config.json", "generation_config.json", "model.safetensors"]  # the source's generation config too
    assert names == sorted(p.name for p in b.iterdir()) == expected
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_params_pytree_export_and_dtype_cast(tiny_checkpoints, mesh_2x4, tmp_path):
    src, _ = tiny_checkpoints("llama")
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=False)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    out = export_hf(params, tmp_path / "bf16", config=src, dtype="bf16")
    ref = {k: v.astype(ml_dtypes.bfloat16) for k, v in read_tensors(src).items()}
    assert_bit_exact(read_tensors(out), ref)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert [p.name for p in out.glob("*.safetensors")] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()


def test_existing_output_is_kept_unless_overwrite(tiny_checkpoints, mesh_2x4, tmp_path):
    src, _ = tiny_checkpoints("llama_tied")
    model = otfload.from_pretrained(src, mesh=mesh_2x4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(OutputExistsError):
        export_hf(model, out, reference=src)
    assert (out / "keep.txt").read_text() == "mine"
    export_hf(model, out, reference=src, overwrite=True)
    assert not (out / "keep.txt").exists()
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp dir left behind


def test_failure_mid_export_leaves_no_output(tiny_checkpoints, mesh_2x4, tmp_path, monkeypatch):
    src, _ = tiny_checkpoints("llama")
    model = otfload.from_pretrained(src, mesh=mesh_2x4)
    with pytest.raises(TypeError):
        export_hf(model, tmp_path / "bad_dtype", reference=src, dtype="no-such-dtype")
    real, calls = writer.write_safetensors, []

    def fail_on_third_shard(path, specs, produce, *written):
        calls.append(path)
        if len(calls) == 3:
            raise OSError("disk full")
        real(path, specs, produce, *written)

    monkeypatch.setattr(writer, "write_safetensors", fail_on_third_shard)
    with pytest.raises(OSError, match="disk full"):
        export_hf(model, tmp_path / "out", reference=src, max_shard_size="60KB")
    assert len(calls) == 3
    assert list(tmp_path.iterdir()) == []  # the shards already written went with the temp dir


def test_a_loaded_model_exports_with_no_config_or_reference(tiny_checkpoints, mesh_2x4, tmp_path):
    """from_pretrained's model remembers its config and family: the bare call round-trips exactly."""
    src, _ = tiny_checkpoints("qwen3")
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=False)
    out = export_hf(model, tmp_path / "out")
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"


def test_params_without_config_or_reference_are_refused(tiny_checkpoints, mesh_2x4, tmp_path):
    src, _ = tiny_checkpoints("llama")
    params = nnx.state(otfload.from_pretrained(src, mesh=mesh_2x4), nnx.Param)  # a tree: no origin
    with pytest.raises(MappingError, match="config"):
        export_hf(params, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_export_checkpoint_is_the_cli_round_trip(tiny_checkpoints, mesh_2x4, tmp_path):
    src, _ = tiny_checkpoints("qwen3")
    out = export_checkpoint(src, tmp_path / "out", mesh=mesh_2x4, scan_layers=False, max_shard_size="60KB")
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert weight_map_keys(out) == weight_map_keys(src)
