"""The key of a kept program (``otfload.programs``): the same in every process for the same program
(the second job in a fresh process is ``tests/cli/test_eval_programs.py`` and
``tests/lmeval/test_cli.py``), and another key whenever something that shapes the program differs:
the model's config, an argument's shape or dtype, the shardings and which devices they name, the
output shardings, XLA's flags. What cannot be keyed is not kept (key None)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import otfload
from otfload.evaluate import _nll_of_batch
from otfload.plan.sharding import make_mesh
from otfload.programs import CachedJit


@pytest.fixture(scope="module")
def models(tiny_checkpoints, mesh_2x4):
    llama, _ = tiny_checkpoints("llama")
    tied, _ = tiny_checkpoints("llama_tied")
    mesh_4x2 = make_mesh({"fsdp": 4, "tp": 2})
    return (otfload.from_pretrained(llama, mesh=mesh_2x4), otfload.from_pretrained(llama, mesh=mesh_2x4),
            otfload.from_pretrained(tied, mesh=mesh_2x4), otfload.from_pretrained(llama, mesh=mesh_4x2))


def batch(width: int = 16, dtype=np.int32) -> tuple[np.ndarray, np.ndarray]:
    return np.zeros((4, width), dtype), np.ones((4, width), bool)


def test_the_same_program_has_one_key_and_what_shapes_it_changes_it(models, mesh_2x4, monkeypatch):
    llama, llama_again, tied, llama_4x2 = models
    step = CachedJit(_nll_of_batch)
    key = step.key(llama, *batch())
    assert key is not None and len(key) == 64
    assert step.key(llama_again, *batch()) == key  # loaded again: same structure, shapes, shardings
    others = [
        step.key(tied, *batch()),  # another config (tied embeddings)
        step.key(llama_4x2, *batch()),  # the same model on another mesh
        step.key(llama, *batch(32)),  # another width
        step.key(llama, *batch(dtype=np.int16)),  # another dtype
        CachedJit(_nll_of_batch, out_shardings=NamedSharding(mesh_2x4, PartitionSpec())).key(llama, *batch()),
    ]
    reversed_devices = make_mesh({"fsdp": 2, "tp": 4}, devices=list(reversed(jax.devices())))
    ids = jax.device_put(batch()[0], NamedSharding(mesh_2x4, PartitionSpec("fsdp")))
    ids_reversed = jax.device_put(batch()[0], NamedSharding(reversed_devices, PartitionSpec("fsdp")))
    assert step.key(llama, ids, batch()[1]) != step.key(llama, ids_reversed, batch()[1])  # same axes, other devices
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_cpu_enable_fast_math=true")
    others.append(step.key(llama, *batch()))
    assert len({key, *others}) == len(others) + 1


def test_what_cannot_be_keyed_is_not_kept(models):
    llama = models[0]
    step = CachedJit(_nll_of_batch)
    assert step.key(llama, *batch(), 1.5) is None  # a leaf that is no array

    def scale(x):
        return x * 2

    assert step.key(jax.tree_util.Partial(scale), *batch()) is None  # a function, named by its address
    factor = jnp.float32(2)
    with pytest.raises(ValueError, match="plain function"):
        CachedJit(lambda x: x * factor)  # a closure's values would not be in the key
