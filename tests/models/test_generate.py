"""Greedy decoding with a KV cache: ``otfload.generate`` equals transformers' greedy ``generate``
on every family, left-padded batches included; the cache reproduces the full forward pass and is
sharded on the mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import otfload
from otfload.generate import _step, cache_shardings
from otfload.plan.sharding import make_mesh
from tests.helpers import max_rel_diff
from tests.models.kinds import KINDS, padded_batch, torch_greedy

NEW = 6  # new tokens: enough to cross the tiny models' sliding windows (4) while decoding


def _left_padded():
    ids, mask, _ = padded_batch("left")
    return ids[:, 4:], mask[:, 4:]  # 8 slots: rows of 8, 4 and 1 real tokens


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers_on_a_left_padded_batch(tiny_checkpoints, mesh_2x4, kind):
    path, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask = _left_padded()
    ours = np.asarray(otfload.generate(model, ids, max_new_tokens=NEW, attention_mask=mask))
    assert ours.shape == (3, ids.shape[1] + NEW)
    np.testing.assert_array_equal(ours[:, : ids.shape[1]], ids)  # prompt and pad slots unchanged
    np.testing.assert_array_equal(ours, torch_greedy(torch_model, ids, mask, NEW))


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3"])
def test_unscanned_expert_parallel_greedy_matches_transformers(tiny_checkpoints, kind):
    path, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=make_mesh({"fsdp": 2, "ep": 4}), scan_layers=False)
    ids, mask = _left_padded()
    ours = np.asarray(otfload.generate(model, jnp.asarray(ids), max_new_tokens=NEW, attention_mask=mask == 1))
    np.testing.assert_array_equal(ours, torch_greedy(torch_model, ids, mask, NEW))


def test_rows_continue_with_pad_after_eos_as_transformers_does(tiny_checkpoints, mesh_2x4):
    path, torch_model = tiny_checkpoints("llama")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask = _left_padded()
    # With the checkpoint's own EOS id (the programs test_greedy_matches_transformers...[llama] compiled),
    # which row 0's first new token is not: its second new token is as without EOS ids, and ends row 0
    # (and maybe others) below.
    free = np.asarray(otfload.generate(model, ids, max_new_tokens=NEW, attention_mask=mask))
    assert free[0, ids.shape[1]] != torch_model.generation_config.eos_token_id
    eos = int(free[0, ids.shape[1] + 1])
    pad = 7
    ours = np.asarray(otfload.generate(model, ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=eos,
                                       pad_token_id=pad))
    assert ours[0, ids.shape[1] + 1] == eos and (ours[0, ids.shape[1] + 2 :] == pad).all()
    ref = torch_greedy(torch_model, ids, mask, NEW, eos_token_id=eos, pad_token_id=pad)
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("kind", ["gemma2", "gpt_oss", "deepseek_v2", "qwen3_moe"])
def test_cached_steps_reproduce_the_full_forward(tiny_checkpoints, mesh_2x4, kind):
    """Prefill 5 slots, then feed the rest one token at a time through the cache: each step's
    logits equal the full padded forward pass at that slot (windows, sinks, MLA latents)."""
    path, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask, _ = padded_batch("left")
    full = np.asarray(jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, ids, mask))
    step = jax.jit(lambda m, i, a, c: m(i, attention_mask=a, cache=c))
    cache = model.init_cache(ids.shape[0], ids.shape[1])
    logits, cache = step(model, ids[:, :5], mask[:, :5], cache)
    got = [np.asarray(logits)]
    for t in range(5, ids.shape[1]):
        logits, cache = step(model, ids[:, t : t + 1], mask[:, t : t + 1], cache)
        got.append(np.asarray(logits))
    got = np.concatenate(got, axis=1)
    real = mask.astype(bool)
    assert max_rel_diff(got[real], full[real]) <= 1e-5
    assert int(cache["index"]) == ids.shape[1]


def test_cache_is_sharded_on_the_model_mesh(tiny_checkpoints):
    """The decode step keeps the cache sharded: batch on the batch axes, kv heads on ``tp``."""
    path, _ = tiny_checkpoints("llama")
    mesh = make_mesh({"fsdp": 2, "tp": 2, "ep": 2})
    model = otfload.from_pretrained(path, mesh=mesh)
    ids = np.ones((2, 4), np.int32)
    with jax.set_mesh(mesh):
        cache = model.init_cache(2, 6)
        cache = jax.device_put(cache, cache_shardings(cache, mesh))
        args = (model, ids, np.ones_like(ids, bool), np.arange(4)[None].repeat(2, 0), cache, jnp.ones((2,), bool))
        _, cache, _ = _step.compile(*args, eos=(), pad=None, mesh=mesh).compiled(*args)
    k = cache["layers"]["layers"]["k"]  # [layers, batch, slots, kv heads, head dim]
    assert k.sharding.spec == P(None, "fsdp", None, "tp")
    assert cache["mask"].sharding.spec == P("fsdp")


def test_bad_arguments_are_errors(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask = _left_padded()
    with pytest.raises(ValueError, match="attention_mask has shape"):
        otfload.generate(model, ids, 2, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="max_new_tokens"):
        otfload.generate(model, ids, -1)
    np.testing.assert_array_equal(np.asarray(otfload.generate(model, ids, 0)), ids)
