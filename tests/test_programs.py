"""The key of a kept program (``otfload.programs``): the same in every process for the same program
(the second job in a fresh process is ``tests/cli/test_eval_programs.py``, ``tests/lmeval/test_cli.py``
and, for the decoding steps, the last test here), and another key whenever something that shapes
the program differs: the model's config, an argument's shape or dtype, the shardings and which
devices they name, the output shardings, XLA's flags, a static value (EOS ids, pad id, mesh), the
donated arguments, the mesh the call runs under. What cannot be keyed is not kept (key None)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import otfload
from otfload.evaluate import _nll_of_batch
from otfload.generate import _decoding_step, _step, cache_shardings
from otfload.plan.sharding import make_mesh
from otfload.programs import DIR_NAME, CachedJit
from tests import forked


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


def step_arguments(model, mesh, width: int = 8, new_tokens: int = 6) -> tuple:
    """The prefill step's arguments as ``otfload.generate`` passes them: prompt ``[4, width]``, the
    cache of ``width + new_tokens`` slots on the mesh."""
    ids, mask = batch(width)
    cache = model.init_cache(4, width + new_tokens)
    cache = jax.device_put(cache, cache_shardings(cache, mesh))
    return model, ids, mask, np.zeros((4, width), np.int32), cache, jnp.ones((4,), bool)


def test_static_values_donation_and_the_ambient_mesh_are_in_the_key(models, mesh_2x4):
    llama, llama_again, _, llama_4x2 = models
    statics = {"eos": (2,), "pad": 0, "mesh": mesh_2x4}
    with jax.set_mesh(mesh_2x4):
        key = _step.key(*step_arguments(llama, mesh_2x4), **statics)
        assert key is not None
        assert _step.key(*step_arguments(llama_again, mesh_2x4), **statics) == key
        others = [
            _step.key(*step_arguments(llama, mesh_2x4), **{**statics, "eos": (3,)}),  # another EOS id
            _step.key(*step_arguments(llama, mesh_2x4), **{**statics, "eos": (2, 3)}),
            _step.key(*step_arguments(llama, mesh_2x4), **{**statics, "pad": 1}),  # another pad id
            _step.key(*step_arguments(llama, mesh_2x4, width=16), **statics),  # another prompt width
            _step.key(*step_arguments(llama, mesh_2x4, new_tokens=10), **statics),  # another max_gen_toks
            CachedJit(_decoding_step, static_argnames=("eos", "pad", "mesh")).key(  # nothing donated
                *step_arguments(llama, mesh_2x4), **statics),
        ]
    others.append(_step.key(*step_arguments(llama, mesh_2x4), **statics))  # not under the mesh
    mesh_4x2 = make_mesh({"fsdp": 4, "tp": 2})
    with jax.set_mesh(mesh_4x2):
        others.append(_step.key(*step_arguments(llama_4x2, mesh_4x2), **{**statics, "mesh": mesh_4x2}))
    assert len({key, *others}) == len(others) + 1


def test_static_arguments_are_checked(models, mesh_2x4):
    llama = models[0]
    with pytest.raises(TypeError, match=r"static arguments \['eos'\] given; expected \['eos', 'mesh', 'pad'\]"):
        _step.compile(*step_arguments(llama, mesh_2x4), eos=(2,))


# A decoding job in a fresh process with a compilation cache: the ids of a left-padded batch, the
# seconds spent getting the programs (twice: the second call's come from this process's), and
# whether the cache passed to the (loaded or compiled) step program was donated.
GENERATE_JOB = """
import json, sys
import jax, jax.numpy as jnp, numpy as np
from otfload.compile_cache import enable_compile_cache
enable_compile_cache(sys.argv[2])
import otfload
from otfload.generate import _step, cache_shardings, timed_generate
from otfload.plan.sharding import make_mesh
mesh = make_mesh({"fsdp": 2, "tp": 4})
model = otfload.from_pretrained(sys.argv[1], mesh=mesh)
ids = np.array([[0, 0, 5, 9, 7, 3], [4, 8, 2, 6, 1, 5]], np.int32)
first, again = (timed_generate(model, ids, 5, ids > 0, eos_token_id=[], pad_token_id=0) for _ in range(2))
with jax.set_mesh(mesh):
    cache = model.init_cache(2, 11)
    cache = jax.device_put(cache, cache_shardings(cache, mesh))
    args = (model, ids, ids > 0, np.zeros_like(ids), cache, jnp.ones((2,), bool))
    _step.compile(*args, eos=(), pad=0, mesh=mesh).compiled(*args)
print(json.dumps({"ids": np.asarray(first.ids).tolist(), "compile": first.compile_seconds,
                  "lower": first.lower_seconds, "again": again.compile_seconds,
                  "donated": all(x.is_deleted() for x in jax.tree.leaves(cache))}))
"""


def test_a_second_process_decodes_with_the_kept_step_programs(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints("llama")
    cache = tmp_path / "xla"

    def job(run: Callable[..., subprocess.CompletedProcess]) -> dict:
        out = run([sys.executable, "-c", GENERATE_JOB, str(path), str(cache)], capture_output=True, text=True,
                  timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])

    first = job(subprocess.run)
    kept = {p.name: p.read_bytes() for p in (cache / DIR_NAME).iterdir()}
    assert len(kept) == 2 and all(name.startswith("_decoding_step-") for name in kept)  # prefill, decode
    assert first["lower"] > 0 and first["again"] == 0.0  # the second call: this process's programs
    second = job(forked.run)  # forked from tests.forked's server: a fresh process, its imports done
    assert second["ids"] == first["ids"]
    assert second["lower"] == 0.0 and second["compile"] < first["compile"] / 4  # read, not traced or compiled
    assert {p.name: p.read_bytes() for p in (cache / DIR_NAME).iterdir()} == kept  # none written again
    assert first["donated"] and second["donated"]  # a loaded program reuses the cache's buffers too


def test_compile_cache_default_that_cannot_be_made_warns_and_a_named_one_fails(tmp_path, monkeypatch):
    """A job's default compile-cache directory that cannot be made (a read-only home) leaves JAX's
    setting alone with a warning; a directory the user names that cannot be made is an error."""
    import jax

    from otfload.compile_cache import ENV_VAR, CompileCacheWarning, enable_compile_cache
    from otfload.errors import InvalidOptionError

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a directory cannot be made under a file, whoever runs the test
    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv(ENV_VAR, str(blocked / "xla"))
    with pytest.warns(CompileCacheWarning, match="a-file"):
        assert enable_compile_cache(None) is None
    with pytest.raises(InvalidOptionError, match="a-file"):
        enable_compile_cache(str(blocked / "named"))
    assert enable_compile_cache("off") is None
    assert jax.config.jax_compilation_cache_dir == before
