"""End to end: HF checkpoints written by transformers → otfload → logits equal transformers'."""

import json
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import otfload
from otfload.errors import (
    CheckpointMismatchError,
    HeaderError,
    MissingTensorError,
    ShapeMismatchError,
    TruncatedFileError,
    UnexpectedTensorError,
    UnknownDtypeError,
    UnsupportedModelError,
)
from otfload.plan.abstract import dotted
from tests.helpers import hf_tensors, max_rel_diff, token_ids, torch_logits
from tests.helpers import jax_logits as logits

F32_KINDS = ["llama", "llama_tied", "mistral", "qwen2", "qwen2_tied", "qwen3", "qwen3_tied"]




@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", F32_KINDS)
def test_f32_logits_match_transformers(tiny_checkpoints, mesh_2x4, kind, scan_layers):
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1  # several shard files are really used
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers)
    ids = token_ids(seq=20)  # longer than mistral's sliding window of 8
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4


def test_bf16_checkpoint_keeps_storage_dtype_and_matches(tiny_checkpoints, mesh_2x4):
    path, torch_model = tiny_checkpoints("llama_bf16")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    assert model.layers.attn.q.kernel[...].dtype == jnp.bfloat16
    ids = token_ids()
    # bf16 has an 8-bit mantissa (relative step 2**-8 ≈ 0.4%); two bf16 implementations that round
    # in different places over 3 layers drift by a few steps, so allow 5%.
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 5e-2


def test_bf16_checkpoint_cast_to_f32_is_exact_to_the_stored_values(tiny_checkpoints, mesh_2x4):
    from safetensors.numpy import load_file

    path, _ = tiny_checkpoints("llama_bf16")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32")
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(f))
    got = np.asarray(model.layers.mlp.down.kernel[...])
    want = np.stack([stored[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(3)]).astype(np.float32)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_every_leaf_has_its_sharding_and_per_shard_values(tiny_checkpoints, mesh_2x4):

    path, _ = tiny_checkpoints("llama")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    hf = hf_tensors(path)
    heads, hd, h = 4, 16, 64
    expected = {
        "embed.embedding": (hf["model.embed_tokens.weight"], P("tp", "fsdp")),
        "lm_head.kernel": (hf["lm_head.weight"], P("tp", "fsdp")),
        "layers.attn.q.kernel": (
            np.stack([hf[f"model.layers.{i}.self_attn.q_proj.weight"].reshape(heads, hd, h) for i in range(3)]),
            P(None, "tp", None, "fsdp"),
        ),
        "layers.attn.o.kernel": (
            np.stack([hf[f"model.layers.{i}.self_attn.o_proj.weight"].reshape(h, heads, hd) for i in range(3)]),
            P(None, "fsdp", "tp"),
        ),
        "layers.mlp.down.kernel": (
            np.stack([hf[f"model.layers.{i}.mlp.down_proj.weight"] for i in range(3)]),
            P(None, "fsdp", "tp"),
        ),
    }
    state = dict(nnx_flat(model))
    for path_, (want, spec) in expected.items():
        arr = state[path_]
        assert arr.sharding == NamedSharding(mesh_2x4, spec), path_
        assert len(arr.addressable_shards) == 8
        for shard in arr.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index], err_msg=path_)
    # every other leaf too: its sharding is the one the rules give
    for key, arr in state.items():
        assert isinstance(arr.sharding, NamedSharding) and arr.sharding.mesh == mesh_2x4, key


def test_shards_do_not_share_buffers(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    norm = model.final_norm.scale[...]  # replicated on all 8 devices
    pointers = {s.data.unsafe_buffer_pointer() for s in norm.addressable_shards}
    assert len(pointers) == 8


def nnx_flat(model):
    from flax import nnx

    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        yield dotted(path), var[...]


def test_report_counts_bytes_and_reads_each_byte_once_on_one_host(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    model, report = otfload.from_pretrained(path, mesh=mesh_2x4, return_report=True)
    total = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    assert report.leaves == len(list(nnx_flat(model)))
    assert 0 < report.bytes_planned < total
    # shards of sharded leaves are disjoint, replicated boxes are built once per process
    assert report.bytes_read == report.bytes_planned
    assert report.bytes_needed == report.bytes_read and report.over_read == 1.0
    assert report.host_route == "CPU devices: host buffers adopted, no copy"  # no DMA ring on CPU devices
    assert 0 < report.first_leaf_seconds <= report.seconds
    assert report.seconds > 0 and report.peak_rss > 0
    assert "GB/s" in report.summary() and "over-read 1.00x" in report.summary()


def test_load_params_for_a_user_pytree(tiny_checkpoints, mesh_2x4):

    path, _ = tiny_checkpoints("llama")
    hf = hf_tensors(path)
    sharded = NamedSharding(mesh_2x4, P(None, "tp"))
    abstract = {
        "params": {
            "wq": jax.ShapeDtypeStruct((3, 64, 64), np.float32, sharding=sharded),
            "emb": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(mesh_2x4, P("fsdp"))),
        }
    }
    mapping = [
        otfload.Rule("params.wq", "model.layers.{layer}.self_attn.q_proj.weight", (otfload.Transpose(),)),
        otfload.Rule("params.emb", "model.embed_tokens.weight"),
    ]
    tree = otfload.load_params(path, abstract, mapping)
    assert tree["params"]["wq"].sharding == sharded
    want = np.stack([hf[f"model.layers.{i}.self_attn.q_proj.weight"].T for i in range(3)])
    np.testing.assert_array_equal(np.asarray(tree["params"]["wq"]), want)
    np.testing.assert_array_equal(np.asarray(tree["params"]["emb"]), hf["model.embed_tokens.weight"])


def test_tied_checkpoint_feeds_both_leaves_from_one_key(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama_tied")
    abstract = {
        "emb": jax.ShapeDtypeStruct((256, 64), np.float32, sharding=NamedSharding(mesh_2x4, P())),
        "head": jax.ShapeDtypeStruct((64, 256), np.float32, sharding=NamedSharding(mesh_2x4, P())),
    }
    mapping = [
        otfload.Rule("emb", "model.embed_tokens.weight"),
        otfload.Rule("head", "lm_head.weight", (otfload.Transpose(),), fallbacks=("model.embed_tokens.weight",)),
    ]
    tree = otfload.load_params(path, abstract, mapping)
    np.testing.assert_array_equal(np.asarray(tree["head"]), np.asarray(tree["emb"]).T)


# --- errors -------------------------------------------------------------------------------------


def copy_checkpoint(tiny_checkpoints, tmp_path, kind="llama"):
    src, _ = tiny_checkpoints(kind)
    dst = tmp_path / kind
    shutil.copytree(src, dst)
    return dst


def shard_of(path, key):
    return path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_truncated_file_is_a_typed_error(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    f = shard_of(path, "model.norm.weight")
    f.write_bytes(f.read_bytes()[:-10])
    with pytest.raises(TruncatedFileError, match=f.name):
        otfload.from_pretrained(path)


def test_header_offset_past_end_is_a_typed_error(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    f = shard_of(path, "model.norm.weight")
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    begin, end = header[key]["data_offsets"]
    header[key]["data_offsets"] = [begin + 10**9, end + 10**9]
    new = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n :])
    with pytest.raises((HeaderError, TruncatedFileError), match=key.replace(".", r"\.")):
        otfload.from_pretrained(path)


def test_wrong_dtype_string_is_a_typed_error(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    f = shard_of(path, "model.norm.weight")
    raw = f.read_bytes()
    assert b'"F32"' in raw[:4096]
    f.write_bytes(raw.replace(b'"F32"', b'"Q32"', 1))
    with pytest.raises(UnknownDtypeError, match="Q32"):
        otfload.from_pretrained(path)


def rewrite_shard(path, key, change):
    from safetensors.numpy import load_file, save_file

    f = shard_of(path, key)
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k in tensors or v != f.name}
    index["weight_map"].update({k: f.name for k in tensors})
    index_file.write_text(json.dumps(index))


def test_missing_tensors_are_reported_together(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    for key in ["model.layers.1.mlp.up_proj.weight", "model.norm.weight"]:
        rewrite_shard(path, key, lambda t, key=key: t.pop(key))
    with pytest.raises(MissingTensorError) as err:
        otfload.from_pretrained(path)
    keys = {p.hf_key for p in err.value.missing}
    assert keys == {"model.layers.1.mlp.up_proj.weight", "model.norm.weight"}
    assert "layers.mlp.up.kernel" in str(err.value) and "final_norm.scale" in str(err.value)


def test_shape_mismatch_names_key_leaf_and_shapes(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    key = "model.layers.2.self_attn.k_proj.weight"
    rewrite_shard(path, key, lambda t: t.__setitem__(key, np.zeros((16, 64), np.float32)))
    with pytest.raises(ShapeMismatchError) as err:
        otfload.from_pretrained(path, scan_layers=False)
    (problem,) = err.value.mismatched
    assert problem.hf_key == key and problem.leaf == "layers.2.attn.k.kernel"
    assert "(2, 16, 64)" in str(err.value) and "(16, 64)" in str(err.value)


def test_unexpected_tensors_are_skipped_or_strict_errors(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    key = "model.norm.weight"
    rewrite_shard(path, key, lambda t: t.__setitem__("model.extra.weight", np.ones(3, np.float32)))
    _, report = otfload.from_pretrained(path, return_report=True)
    assert report.unused_tensors == ["model.extra.weight"]
    with pytest.raises(UnexpectedTensorError, match="model.extra.weight"):
        otfload.from_pretrained(path, strict=True)


def test_mixed_problems_raise_the_base_mismatch_error(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    rewrite_shard(path, "model.norm.weight", lambda t: t.pop("model.norm.weight"))
    key = "model.layers.0.mlp.gate_proj.weight"
    rewrite_shard(path, key, lambda t: t.__setitem__(key, np.zeros((3,), np.float32)))
    with pytest.raises(CheckpointMismatchError) as err:
        otfload.from_pretrained(path)
    assert type(err.value) is CheckpointMismatchError
    assert len(err.value.missing) == 1 and len(err.value.mismatched) == 1


def test_unsupported_model_type_is_named(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "made_up_lm"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="made_up_lm"):
        otfload.from_pretrained(path)


def test_preadv_and_mmap_reads_give_identical_params(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("qwen2")
    mapped = dict(nnx_flat(otfload.from_pretrained(path, mesh=mesh_2x4)))
    read = dict(nnx_flat(otfload.from_pretrained(path, mesh=mesh_2x4, mmap=False)))
    assert mapped.keys() == read.keys()
    for key in mapped:
        np.testing.assert_array_equal(np.asarray(mapped[key]), np.asarray(read[key]), err_msg=key)


def open_fds() -> int:
    import os

    return len(os.listdir("/proc/self/fd"))


def test_loads_close_the_files_they_open(tiny_checkpoints, tmp_path, mesh_2x4):
    path = copy_checkpoint(tiny_checkpoints, tmp_path)
    otfload.from_pretrained(path, mesh=mesh_2x4)  # warm up lazily opened library files
    before = open_fds()
    for _ in range(3):
        otfload.from_pretrained(path, mesh=mesh_2x4)
    rewrite_shard(path, "model.norm.weight", lambda t: t.pop("model.norm.weight"))
    for _ in range(3):
        with pytest.raises(MissingTensorError):
            otfload.from_pretrained(path, mesh=mesh_2x4)
    assert open_fds() <= before


def test_default_workers_follow_the_source_and_the_devices(tmp_path):
    """Local files onto CPU devices: 2 builders (CPU-bound); onto accelerators: half the CPUs, 2 to 8
    (the host makes one copy per byte); remote sources: 8 (latency-bound)."""
    import os
    from types import SimpleNamespace

    from otfload.opening import default_workers
    from otfload.sources import LocalSource

    local = LocalSource(tmp_path)
    gpu = [SimpleNamespace(platform="gpu")]  # only the platform is asked
    assert default_workers(local) == 2
    assert default_workers(local, gpu) == max(2, min(8, (os.cpu_count() or 1) // 2))
