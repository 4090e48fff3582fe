"""Helpers for the config tests: tiny real checkpoints (every family) with a rewritten ``config.json``
or with tensors removed."""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

# The family test modules register their tiny transformers models with the session fixture.
import tests.families.test_deepseek
import tests.families.test_gemma
import tests.families.test_gpt_oss
import tests.families.test_mixtral
import tests.families.test_qwen3_moe  # noqa: F401

INDEX = "model.safetensors.index.json"
DELETE = object()  # a change that removes the field


def changed(config: dict, changes: Mapping[str, object]) -> dict:
    """``config`` with each dotted path set to its value (or removed, for :data:`DELETE`)."""
    out = copy.deepcopy(config)
    for path, value in changes.items():
        *parents, last = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        if value is DELETE:
            node.pop(last, None)
        else:
            node[last] = value
    return out


def copy_checkpoint(tiny_checkpoints: Callable, dst: Path, kind: str) -> Path:
    src, _ = tiny_checkpoints(kind)
    shutil.copytree(src, dst)
    return dst


def write_config(path: Path, config: object) -> None:
    (path / "config.json").write_text(json.dumps(config))


def with_config(tiny_checkpoints: Callable, dst: Path, kind: str, changes: Mapping[str, object]) -> Path:
    """A copy of the tiny ``kind`` checkpoint at ``dst`` whose config.json has ``changes`` applied."""
    path = copy_checkpoint(tiny_checkpoints, dst, kind)
    write_config(path, changed(json.loads((path / "config.json").read_text()), changes))
    return path


def drop_tensors(path: Path, keys: list[str]) -> None:
    """Remove ``keys`` from the checkpoint at ``path`` (their shards and the index)."""
    from safetensors.numpy import load_file, save_file

    index = json.loads((path / INDEX).read_text())
    for file in {index["weight_map"][k] for k in keys}:
        tensors = {k: v for k, v in load_file(path / file).items() if k not in keys}
        save_file(tensors, path / file, metadata={"format": "pt"})
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in keys}
    (path / INDEX).write_text(json.dumps(index))
