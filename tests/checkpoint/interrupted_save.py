"""Run as a script by the kill test: start a large async save of step 2, announce it, then wait on it."""

import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

from otfload.checkpoint import CheckpointConfig, OrbaxCheckpointManager  # noqa: E402
from otfload.plan.sharding import make_mesh  # noqa: E402


def main(directory: str, mebibytes: int) -> None:
    sharding = NamedSharding(make_mesh({"fsdp": 8}), PartitionSpec("fsdp"))
    rng = np.random.default_rng(1)
    rows = mebibytes * 2**20 // (8 * 1024 * 4)
    state = {f"w{i}": jax.device_put(rng.random((rows, 1024), np.float32), sharding) for i in range(8)}
    manager = OrbaxCheckpointManager(CheckpointConfig(directory, async_save=True))
    manager.save(2, state)
    print("SAVING", flush=True)
    manager.finalize()
    print("DONE", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
