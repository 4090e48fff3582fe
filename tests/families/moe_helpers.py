"""Checks shared by the MoE family tests: logits parity on a mesh (experts really sharded where the
mesh has an ``ep`` axis) and the error for a wrong-shaped expert tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import otfload
from otfload.errors import ShapeMismatchError
from tests.families.checks import MESHES as MESHES  # re-exported: other MoE tests read the meshes here
from tests.families.checks import expert_parallel_diff, load_sharded
from tests.helpers import BASE

# 4 experts, top 2, 3 layers, hidden 64 (BASE); 12-token inputs.
MOE_BASE = {**BASE, "num_experts_per_tok": 2}


def parity_cases(kind: str, variant: str) -> list[tuple[str, bool, str]]:
    """``(kind, scan_layers, mesh)``: ``kind`` unscanned with experts on ``ep`` and scanned on ``tp``,
    ``variant`` (another config of the family) scanned on ``ep``: both scan values and both meshes for the
    family, scanned on both meshes, without every combination."""
    return [(kind, False, "fsdp2_ep4"), (kind, True, "fsdp2_tp4"), (variant, True, "fsdp2_ep4")]




def expert_kernel(model, scan_layers: bool):
    """The gate kernel of the first MoE layer's experts (the whole stack when scanned)."""
    return model.layers.moe.gate.kernel[...] if scan_layers else model.layers[0].moe.gate.kernel[...]


def check_parity(tiny_checkpoints, kind: str, mesh_name: str, scan_layers: bool) -> float:
    """Load ``kind`` on the named mesh and return the max relative logits difference to transformers,
    the experts checked expert-parallel where the mesh has ``ep`` (:func:`expert_parallel_diff`)."""
    model, torch_model, mesh = load_sharded(tiny_checkpoints, kind, mesh_name, scan_layers)
    return expert_parallel_diff(model, torch_model, mesh, expert_kernel(model, scan_layers), scan_layers)


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
