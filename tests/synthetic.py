"""Small synthetic safetensors checkpoints written with numpy (no transformers needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


def write_checkpoint(path: Path, tensors: dict[str, np.ndarray], files: int = 2, config: dict | None = None) -> Path:
    """Split ``tensors`` round-robin over ``files`` shards with an index.json, plus a config.json."""
    path.mkdir(parents=True, exist_ok=True)
    names = [f"model-{i + 1:05d}-of-{files:05d}.safetensors" for i in range(files)]
    shards: list[dict] = [{} for _ in names]
    weight_map = {}
    for i, (key, value) in enumerate(sorted(tensors.items())):
        shards[i % files][key] = value
        weight_map[key] = names[i % files]
    for name, shard in zip(names, shards, strict=True):
        save_file(shard, path / name)
    index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config or {"model_type": "synthetic"}))
    return path
