"""The ``otfload`` command line: the real console script in a subprocess on tiny local checkpoints,
plus in-process calls of ``otfload.cli.main`` where only the command's logic is under test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import otfload
from otfload.cli import main
from otfload.cli.inspect import inspect_source
from otfload.errors import SourceNotFoundError
from otfload.plan.sharding import logical_to_spec
from otfload.sources import LocalSource
from tests import forked
from tests.helpers import hf_tensors

OTFLOAD = Path(sys.executable).with_name("otfload")  # the console script pip installed


def otfload_cli(*args: str) -> subprocess.CompletedProcess:
    """Run the installed ``otfload`` script in a fresh process forked from tests.forked's server (its
    imports already done; 8 simulated devices come from conftest's XLA_FLAGS; stderr is no terminal,
    so no progress bar)."""
    return forked.run([str(OTFLOAD), *map(str, args)], timeout=120)



@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama")[0]


@pytest.fixture(scope="module")
def llama_missing_up(llama, tmp_path_factory) -> Path:
    """The tiny llama without ``model.layers.1.mlp.up_proj.weight``."""
    path = tmp_path_factory.mktemp("missing")
    tensors = hf_tensors(llama)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    (path / "config.json").write_text((llama / "config.json").read_text())
    return path


def test_inspect_json_matches_the_abstract_model(llama, mesh_2x4):
    out = otfload_cli("inspect", llama, "--devices", "8", "--mesh", "fsdp=2,tp=4", "--json")
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    model, plan, source = otfload.plan_model(llama, mesh=mesh_2x4, scan_layers=True)
    source.close()
    params = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    got = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    assert set(got) == set(params)
    for path, var in params.items():
        value, axes = var.get_value(), var.get_metadata()["logical_axes"]
        assert got[path]["shape"] == list(value.shape), path
        assert got[path]["dtype"] == str(value.dtype), path
        assert got[path]["sharding"] == str(logical_to_spec(axes, value.shape, mesh_2x4)), path
        assert got[path]["num_hf_keys"] == len(plan.leaves[path].sources)
    q = got["layers.attn.q.kernel"]
    assert q["hf_keys"][0] == "model.layers.0.self_attn.q_proj.weight" and q["stack_axes"] == ["layer"]
    assert q["hooks"] == ["Reshape(shape=(4, 16, 64))"]  # HF's [out, in] kept: no transpose
    assert info["model_type"] == "llama" and info["mesh"] == {"fsdp": 2, "tp": 4}
    # One process holds every device, so it reads every planned byte exactly once.
    assert info["totals"]["process_bytes"] == info["totals"]["source_bytes"] == plan.source_bytes
    assert info["unused"] == []


def test_inspect_text_lists_leaves_keys_and_hooks(llama, capsys):
    assert main(["inspect", str(llama), "--mesh", "fsdp=2,tp=4", "--no-scan-layers"]) == 0
    text = capsys.readouterr().out
    assert "layers.2.mlp.down.kernel  (64, 128) float32  P('fsdp', 'tp')" in text
    assert "← model.layers.2.mlp.down_proj.weight  [float32]" in text
    assert "hooks: Reshape(shape=(4, 16, 64))" in text
    assert "unused tensors (0): none" in text


class RecordingSource:
    """A source that records every byte range read."""

    def __init__(self, inner: LocalSource):
        self.inner, self.reads = inner, []
        self.description = inner.description

    def list_files(self):
        return self.inner.list_files()

    def size(self, file):
        return self.inner.size(file)

    def read_into(self, file, offset, out):
        self.reads.append((file, offset, len(out)))
        self.inner.read_into(file, offset, out)

    def read_many(self, reads):
        for r in reads:
            self.read_into(r.file, r.offset, r.out)

    def close(self):
        self.inner.close()


def test_inspect_reads_no_tensor_bytes(llama, mesh_2x4, monkeypatch, closing):
    # The index speculatively reads 256 KiB per file to get the header in one request, which on
    # tiny files is the whole file; read exactly the header instead so the claim can be checked.
    monkeypatch.setattr("otfload.index.header.HEADER_PREFETCH_BYTES", 8)
    source = closing(RecordingSource(LocalSource(llama)))
    info = inspect_source(source, mesh=mesh_2x4)
    assert info["totals"]["leaves"] == 12
    data = [span for f in llama.glob("*.safetensors") for span in _tensor_spans(f)]
    assert {f for f, _, _ in source.reads} >= {p.name for p in llama.glob("*.safetensors")}
    for file, offset, length in source.reads:
        for name, lo, hi in data:
            assert file != name or offset + length <= lo or offset >= hi, (file, offset, length)


def _tensor_spans(path: Path) -> list[tuple[str, int, int]]:
    """``(file, first byte, end)`` of every tensor's data, from the safetensors layout itself."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    return [(path.name, 8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1])
            for k, e in header.items() if k != "__metadata__" and e["data_offsets"][1] > e["data_offsets"][0]]


def test_inspect_missing_tensor_prints_problems_and_exits_1(llama_missing_up, capsys):
    out = otfload_cli("inspect", llama_missing_up, "--json")
    assert out.returncode == 1, out.stderr
    problems = json.loads(out.stdout)["problems"]
    assert problems == [{"kind": "missing", "hf_key": "model.layers.1.mlp.up_proj.weight",
                         "leaf": "layers.mlp.up.kernel", "expected": [128, 64], "actual": None, "file": None}]
    assert main(["inspect", str(llama_missing_up)]) == 1
    assert "missing tensor 'model.layers.1.mlp.up_proj.weight' needed by leaf" in capsys.readouterr().out


def test_bad_usage_exits_2():
    out = otfload_cli("inspect")
    assert out.returncode == 2 and "required: source" in out.stderr
    for argv in (["inspect", ".", "--mesh", "fsdp=two"], ["load", ".", "--dtype", "float7"], ["frobnicate"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv


def test_typed_error_exits_1_with_its_message_and_no_traceback():
    out = otfload_cli("load", "/nonexistent/checkpoint")
    assert out.returncode == 1
    assert out.stderr.startswith("otfload: error: SourceNotFoundError: checkpoint location '/nonexistent/checkpoint'")
    assert "Traceback" not in out.stderr
    with pytest.raises(SourceNotFoundError):  # --debug lets it through, traceback and all
        main(["load", "/nonexistent/checkpoint", "--debug"])


def test_mesh_needing_other_devices_is_bad_usage_with_a_hint(llama, capsys):
    assert main(["inspect", str(llama), "--mesh", "fsdp=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("otfload: error: DeviceCountError: mesh {'fsdp': 3} needs 3 devices, but 8 are available")
    assert "--mesh with sizes whose product is 8, or --devices 3" in err and "device_count=3" in err


def test_load_verify_matches_transformers(llama):
    out = otfload_cli("load", llama, "--verify", "--devices", "4", "--mesh", "fsdp=2,tp=2")
    assert out.returncode == 0, out.stderr
    assert re.search(r"loaded 12 leaves from 30 tensor reads", out.stdout)
    diff = float(re.search(r"max relative difference vs transformers (\S+)", out.stdout).group(1))
    assert diff <= 1e-4 and "ok" in out.stdout


def test_verify_reports_failure_when_logits_disagree(llama, capsys):
    from otfload.cli.verify import verify

    model = otfload.from_pretrained(llama)
    assert verify(model, str(llama), 256)
    model.layers.mlp.down.kernel[...] = model.layers.mlp.down.kernel[...] * 1.5
    assert not verify(model, str(llama), 256)
    assert capsys.readouterr().out.rstrip().endswith("(float32 forward passes; tolerance 1e-03): FAILED")


def test_verify_of_a_bf16_load_compares_like_with_like(llama):
    """A correct bf16 load passes at float32's tolerance: both forward passes run in float32, ours from
    the weights as loaded, transformers' from its weights rounded to bf16 (not its float32 weights)."""
    out = otfload_cli("load", llama, "--verify", "--dtype", "bf16")
    assert out.returncode == 0, out.stdout + out.stderr
    diff = float(re.search(r"max relative difference vs transformers (\S+)", out.stdout).group(1))
    assert out.stdout.rstrip().endswith("(float32 forward passes of the weights as loaded in bfloat16 "
                                        "(transformers' rounded to bfloat16 too); tolerance 1e-03): ok")
    assert diff <= 1e-4


def test_verify_of_a_quantized_checkpoint_in_its_default_dtype_passes(example_checkpoints, capsys):
    """The FP8 example loads in bf16 (quantized weights count as bf16): transformers' reference decodes
    its weights to dense float32 before they are rounded (its compressed layers would decode with
    bf16 scales: 2.2e-3, a failure of a correct load)."""
    assert main(["load", str(example_checkpoints.quantized), "--verify"]) == 0
    out = capsys.readouterr().out
    diff = float(re.search(r"max relative difference vs transformers (\S+)", out).group(1))
    assert "loaded in bfloat16" in out and diff <= 1e-4, out


def test_bench_prints_each_run(llama, capsys):
    assert main(["bench", str(llama), "--repeats", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines[:2]] == ["run 1", "run 2"]
    assert all(re.search(r"0\.001 GB in [\d.]+ s = [\d.]+ GB/s", line) for line in lines[:2])
    assert lines[2].startswith("best ") and lines[3].startswith("loaded 12 leaves")


def test_export_writes_the_same_tensors(llama, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["export", str(llama), str(out), "--max-shard-size", "100KB"]) == 0
    assert capsys.readouterr().out.strip() == f"exported {llama} to {out}"
    got, want = hf_tensors(out), hf_tensors(llama)
    assert set(got) == set(want) and len(list(out.glob("*.safetensors"))) > 1
    for key in want:
        np.testing.assert_array_equal(got[key], want[key])
    assert main(["export", str(llama), str(out)]) == 1  # exists, no --overwrite
    assert f"{out} exists; pass --overwrite to replace it" in (err := capsys.readouterr().err)
    assert "overwrite=True" not in err  # the flag, not the Python argument


def test_reshard_rewrites_for_the_target_mesh(tmp_path, capsys):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from otfload.checkpoint import CheckpointConfig, LayoutMetadata, OrbaxCheckpointManager
    from otfload.plan.sharding import make_mesh

    mesh = make_mesh({"fsdp": 2, "tp": 4})
    embed = np.arange(32 * 16, dtype=np.float32).reshape(32, 16)
    state = {"embed": jax.device_put(embed, NamedSharding(mesh, P("tp", "fsdp")))}
    meta = LayoutMetadata(logical_axes={"embed": ("vocab", "embed")})
    with OrbaxCheckpointManager(CheckpointConfig(tmp_path / "src")) as manager:
        manager.save(7, state, metadata=meta, wait=True)
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--mesh", "fsdp=8"]) == 0
    assert "resharded step 7" in capsys.readouterr().out
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst2"), "--mesh", "fsdp=8", "--json"]) == 0
    written = {"source": str(tmp_path / "src"), "destination": str(tmp_path / "dst2"), "step": 7, "mesh": {"fsdp": 8}}
    assert json.loads(capsys.readouterr().out) == written
    with OrbaxCheckpointManager(CheckpointConfig(tmp_path / "dst")) as manager:
        assert manager.metadata(7).mesh_axes == {"fsdp": 8}
        target = make_mesh({"fsdp": 8})
        sharding = NamedSharding(target, P(None, "fsdp"))
        abstract = {"embed": jax.ShapeDtypeStruct((32, 16), np.float32, sharding=sharding)}
        np.testing.assert_array_equal(np.asarray(manager.restore(7, abstract)["embed"]), embed)
