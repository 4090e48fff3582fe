"""Qwen3.5 MoE with its routed experts fused, as the bfloat16 releases store them
(``mlp.experts.gate_up_proj [E, 2 * inter, hidden]``, ``mlp.experts.down_proj [E, hidden, inter]``):
test_qwen3_5's tiny MoE checkpoint with its per-expert tensors fused (tests/maxtext/make_refs.py's
``fuse_experts``) → float32 logits equal to transformers' (which loads either layout) with the experts
on ``ep``, the export round trip bit-exact in the fused layout, a wrong expert width refused by name,
and the published 35B-A3B config with fused expert headers planned at 256 devices (tests/realsize.py)."""

import json
import shutil
from pathlib import Path

import jax
import pytest

import otfload
from otfload.errors import ConfigError
from otfload.plan.sharding import make_mesh
from tests.families.checks import assert_export_round_trip, reference_logits
from tests.families.test_hybrid_quantized_realsize import _stored_bytes
from tests.families.test_qwen3_5 import MOE_35B, _replica_tensors
from tests.helpers import jax_logits, max_rel_diff, token_ids
from tests.maxtext.make_refs import fused_copy
from tests.realsize import Spec, inspect_at_scale, write_header_checkpoint

EXPERT = ".mlp.experts."


@pytest.fixture(scope="module")
def fused(tiny_checkpoints, tmp_path_factory):
    """``(the fused copy of the tiny qwen3_5_moe checkpoint, transformers' model of it)``."""
    src, torch_model = tiny_checkpoints("qwen3_5_moe")
    path = fused_copy(src, tmp_path_factory.mktemp("fused") / "qwen3_5_moe")
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in keys
    assert not [k for k in keys if EXPERT in k and k.endswith("_proj.weight")]
    return path, torch_model


@pytest.mark.parametrize("scan_layers", [True, False])
def test_fused_experts_f32_logits_match_transformers(fused, scan_layers):
    path, torch_model = fused
    mesh = make_mesh({"fsdp": 2, "ep": 4})
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    assert report.unused_tensors == []
    gate = model.linear_layers.moe.gate.kernel[...] if scan_layers else model.linear_layers[0].moe.gate.kernel[...]
    assert gate.shape == ((3,) if scan_layers else ()) + (8, 32, 64)
    assert "ep" in str(gate.sharding.spec), gate.sharding.spec  # each device holds (and read) its experts' rows
    ids = token_ids(seq=70)  # two chunks (one chunk: test_qwen3_5's padded rows alone)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(jax_logits(model, ids), reference_logits(torch_model, ids))
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("scan_layers", [True, False])
def test_fused_export_round_trip_is_bit_exact(fused, tmp_path, scan_layers):
    """Export writes the layout of its reference: fused gate_up_proj and down_proj, bit for bit."""
    path, _ = fused
    model = otfload.from_pretrained(path, mesh=make_mesh({"fsdp": 2, "tp": 4}), scan_layers=scan_layers)
    assert_export_round_trip(model, path, tmp_path / "out", ordered=False)


def test_a_wrong_expert_width_is_refused_by_name(fused, tmp_path):
    path, _ = fused
    wrong = tmp_path / "wrong"
    shutil.copytree(path, wrong)
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "moe_intermediate_size": 16}))
    with pytest.raises(ConfigError) as err:
        otfload.plan_model(wrong)
    assert err.value.field == "moe_intermediate_size" and "gate_up_proj" in str(err.value), err.value


def fused_headers(path: Path, published: Path) -> tuple[Path, int]:
    """A published Qwen3.5 MoE config as its bfloat16 release stores it (experts fused per layer),
    headers only, two files; ``(path, its stored bytes)``."""
    real = json.loads(published.read_text())
    text = real["text_config"]
    e, inter, h = text["num_experts"], text["moe_intermediate_size"], text["hidden_size"]
    tensors: dict[str, Spec] = {}
    for name, dtype, shape in _replica_tensors(text):
        if EXPERT not in name:
            tensors[name] = (dtype, shape)
        elif name.endswith(".experts.0.gate_proj.weight"):
            prefix = name.removesuffix("0.gate_proj.weight")
            tensors[f"{prefix}gate_up_proj"] = (dtype, (e, 2 * inter, h))
            tensors[f"{prefix}down_proj"] = (dtype, (e, h, inter))
    names = list(tensors)
    half = len(names) // 2
    shards = {f"model-0000{k + 1}-of-00002.safetensors": {n: tensors[n] for n in part}
              for k, part in enumerate((names[:half], names[half:]))}
    return write_header_checkpoint(path, shards, real), _stored_bytes(tensors)


@pytest.mark.skipif(not MOE_35B.is_file(), reason="../shared/realconfigs is not checked out")
def test_qwen3_5_35b_a3b_fused_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` for process 0 of 32 on fsdp=32 x ep=8: every leaf planned
    within 10 s of the child's CPU and 1 GiB of its own peak, its bytes (held and fetched) within 1.1x
    its devices' share (issue 42: 16 s before the read-layout chooser costed each distinct region of a
    leaf once and the pieces of one region once for its 30 fused tensors; 6.6 s after)."""
    path, stored = fused_headers(tmp_path / "35b", MOE_35B)
    cpu, peak, info = inspect_at_scale(path, "fsdp=32,ep=8")
    assert info["model_type"] == "qwen3_5_moe" and cpu <= 10 and peak <= 2**30, (info["model_type"], cpu, peak)
    totals = info["totals"]
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)
    assert sorted(info["unused"]) == ["model.visual.blocks.0.mlp.linear_fc1.weight", "mtp.fc.weight"]
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    assert leaves["linear_layers.moe.gate.kernel"]["shape"] == [30, 256, 512, 2048]
    assert leaves["attention_layers.moe.down.kernel"]["shape"] == [10, 256, 2048, 512]
    assert leaves["attention_layers.shared_gate.kernel"]["shape"] == [10, 1, 2048]
    used = stored - (4304 * 1152 + 2048 * 4096) * 2  # less the two unused tensors
    assert totals["source_bytes"] == used and 60e9 < used < 75e9, (totals, used)
