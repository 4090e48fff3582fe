"""Checks shared by the MoE family tests: logits parity on a mesh (experts really sharded where the
mesh has an ``ep`` axis) and the error for a wrong-shaped expert tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

import otfload
from otfload.errors import ShapeMismatchError
from otfload.plan.sharding import make_mesh
from tests.helpers import BASE, max_rel_diff, token_ids, torch_logits
from tests.helpers import jax_logits as logits

# 4 experts, top 2, 3 layers, hidden 64 (BASE); 12-token inputs.
MOE_BASE = {**BASE, "num_experts_per_tok": 2}
MESHES = {"fsdp2_tp4": {"fsdp": 2, "tp": 4}, "fsdp2_ep4": {"fsdp": 2, "ep": 4}}


def parity_cases(kind: str, variant: str) -> list[tuple[str, bool, str]]:
    """``(kind, scan_layers, mesh)``: ``kind`` unscanned with experts on ``ep`` and scanned on ``tp``,
    ``variant`` (another config of the family) scanned on ``ep``: both scan values and both meshes for the
    family, scanned on both meshes, without every combination."""
    return [(kind, False, "fsdp2_ep4"), (kind, True, "fsdp2_tp4"), (variant, True, "fsdp2_ep4")]




def expert_kernel(model, scan_layers: bool):
    """The gate kernel of the first MoE layer's experts (the whole stack when scanned)."""
    return model.layers.moe.gate.kernel[...] if scan_layers else model.layers[0].moe.gate.kernel[...]


def check_parity(tiny_checkpoints, kind: str, mesh_name: str, scan_layers: bool) -> float:
    """Load ``kind`` on the named mesh, assert experts sit on ``ep`` when the mesh has it, and return
    the max relative logits difference to transformers."""
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    mesh = make_mesh(MESHES[mesh_name])
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers)
    spec = expert_kernel(model, scan_layers).sharding.spec
    experts_dim = 1 if scan_layers else 0
    assert (spec[experts_dim] == "ep") == ("ep" in MESHES[mesh_name]), spec
    ids = token_ids(seq=12)
    with jax.set_mesh(mesh):  # the sparse experts run expert-parallel (shard_map over "ep") when it has one
        jaxpr = str(jax.make_jaxpr(lambda m, x: m(x))(model, ids))
        assert ("shard_map" in jaxpr) == ("ep" in MESHES[mesh_name])
        return max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))


def replace_tensor(src: Path, dst: Path, key: str, value: np.ndarray) -> None:
    """Copy checkpoint ``src`` to ``dst`` with tensor ``key`` replaced by ``value``."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    shard = dst / json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = value
    save_file(tensors, shard, metadata={"format": "pt"})


def wrong_shape_error(tiny_checkpoints, tmp_path: Path, kind: str, key: str, shape: tuple) -> ShapeMismatchError:
    """The error of loading ``kind`` (scanned) with ``key`` replaced by zeros of ``shape``."""
    src, _ = tiny_checkpoints(kind)
    replace_tensor(src, tmp_path / "ckpt", key, np.zeros(shape, np.float32))
    with pytest.raises(ShapeMismatchError) as err:
        otfload.from_pretrained(tmp_path / "ckpt", scan_layers=True)
    assert all(p.hf_key == key for p in err.value.problems)
    assert key in str(err.value)
    return err.value
