"""Fixtures for the source tests: the real servers, a small sharded checkpoint and a fast retry policy."""

from __future__ import annotations

import gc
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from otfload.sources.retry import RetryPolicy
from tests.servers.fixtures import gcs_server, hub, hub_server, s3_server  # noqa: F401 - fixtures

# Fast bounds for tests: a few quick retries, and a dead server is reported within ~2 s.
FAST_RETRY = RetryPolicy(attempts=6, base_delay_s=0.01, max_delay_s=0.1, deadline_s=2.0, attempt_timeout_s=1.0)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two safetensors shards (~2.5 MB), their index, a config and a README."""
    root = tmp_path_factory.mktemp("checkpoint")
    rng = np.random.default_rng(0)
    shards = {
        "model-00001-of-00002.safetensors": {"embed": rng.standard_normal((256, 1024), dtype=np.float32)},
        "model-00002-of-00002.safetensors": {
            "w1": rng.standard_normal((128, 1024), dtype=np.float32),
            "w2": rng.standard_normal((64, 512), dtype=np.float32),
        },
    }
    weight_map = {}
    for name, tensors in shards.items():
        save_file(tensors, str(root / name))
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "README.md").write_text("not a checkpoint file\n")
    return root


@pytest.fixture(scope="session")
def pickle_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint with only a pickle file (never unpickled: its bytes are arbitrary)."""
    root = tmp_path_factory.mktemp("pickle-checkpoint")
    (root / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    (root / "config.json").write_text("{}")
    return root


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return FAST_RETRY


@pytest.fixture(scope="module", autouse=True)
def release_s3_clients() -> Iterator[None]:
    """Close the S3 clients a module's sources opened once its tests are done: fsspec keeps one per
    set of options, its connections open, for the process's life. (Only where s3:// was used: the
    Hub tests also run in a venv without s3fs.)"""
    yield
    s3 = sys.modules.get("otfload.sources.s3")
    if s3 is not None:
        s3.SingleAttemptS3FileSystem.clear_instance_cache()
        gc.collect()  # s3fs closes a filesystem's client when the filesystem is collected
