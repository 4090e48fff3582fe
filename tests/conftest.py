"""Test-wide setup: 8 simulated CPU devices and shared tiny-checkpoint fixtures.

XLA_FLAGS must be set before JAX initialises its backend, hence at import time here.
"""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.helpers import save_tiny_hf_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Build tiny HF checkpoints lazily, once per session: ``tiny_checkpoints(name) -> (dir, torch model)``."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("hf")

    def get(name: str):
        if name not in cache:
            cache[name] = save_tiny_hf_model(name, root / name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def mesh_2x4():
    from otfload.plan.sharding import make_mesh

    return make_mesh({"fsdp": 2, "tp": 4})


from tests.servers.fixtures import gcs_server, hub, hub_server  # noqa: E402,F401  (real Hub/GCS servers)
