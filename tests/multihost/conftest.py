"""Fixtures of the multi-process and shard-cache tests: one tiny Llama served by the real Hub and GCS servers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.sources.retry import RetryPolicy
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer

REPO = "org/llama-mh"
# A few quick retries: a dead server is reported within ~2 s; a restart within ~1 s is ridden out.
FAST_RETRY = dict(attempts=8, base_delay_s=0.05, max_delay_s=0.5, deadline_s=2.0, attempt_timeout_s=1.0)


@pytest.fixture(scope="session")
def llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama")[0]


@pytest.fixture(scope="session")
def llama_repo(hub_server: HubServer, llama: Path) -> str:
    return hub_server.add_repo(REPO, llama)


@pytest.fixture(scope="session")
def llama_bucket(gcs_server: GcsServer, llama: Path) -> str:
    return gcs_server.upload_dir(llama, "otfload-src", "llama")


@pytest.fixture
def fast_retry() -> RetryPolicy:
    return RetryPolicy(**FAST_RETRY)


def flat_params(model: nnx.Module) -> dict[str, np.ndarray]:
    """Every parameter of ``model`` as a numpy array, by dotted path."""
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


@pytest.fixture(scope="session")
def reference_params(llama: Path, mesh_2x4) -> dict[str, np.ndarray]:
    """The parameters of a one-process load from the local directory."""
    return flat_params(otfload.from_pretrained(llama, mesh=mesh_2x4))


def checkpoint_bytes(directory: Path) -> dict[str, bytes]:
    """Every file otfload reads from a checkpoint directory, by name."""
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.suffix in (".safetensors", ".json")}


def visible_files(root: Path) -> dict[str, bytes]:
    """Files under ``root`` a reader can see (no hidden temporaries), by name."""
    return {p.name: p.read_bytes() for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")}
