"""Native-checkpoint tests run on 8 simulated CPU devices."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402
import pytest  # noqa: E402

from otfload.plan.sharding import make_mesh  # noqa: E402


@pytest.fixture(scope="session")
def mesh():
    """A 2x4 ``fsdp`` x ``tp`` mesh."""
    assert jax.device_count() == 8, "tests/checkpoint needs 8 simulated CPU devices"
    return make_mesh({"fsdp": 2, "tp": 4})
