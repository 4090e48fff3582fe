"""Greedy decoding with a KV cache, as transformers' ``generate(..., do_sample=False)`` does it.

    ids = otfload.generate(model, input_ids, max_new_tokens=32, attention_mask=mask)

The prompt is run once (prefill) into a cache of ``s + max_new_tokens`` slots per row, then one
jit-compiled step per new token reads the cache and appends its keys and values, so a step's cost
does not grow with recomputing the context. The cache is sharded on the model's mesh (batch on the
batch axes, kv heads on ``tp``) and the steps run under that mesh (``jax.set_mesh``), so MoE
experts run expert-parallel on an ``ep`` axis. The step's two programs (prefill and decode) are
:class:`otfload.programs.CachedJit` programs: looked up in this process by the arguments' shapes
after the first call, and kept on disk for the next process where JAX's compilation cache is on
(:func:`timed_generate` says how long getting them took).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.models.attention import CACHE_AXES
from otfload.models.base import CausalLM
from otfload.models.origin import origin_of
from otfload.plan.sharding import logical_to_sharding
from otfload.programs import CachedJit

# A model's KV cache (``CausalLM.init_cache``): ``{"index", "mask", "layers": {group: {"k", "v"}}}``.
KVCache = dict[str, Any]


class ContextLengthWarning(UserWarning):
    """A generation runs past the positions the model was trained for (``max_position_embeddings``)."""


class Generated(NamedTuple):
    """:func:`generate`'s ids and the seconds spent getting its step programs (key, read of a kept
    program, or tracing, lowering and XLA: :class:`otfload.programs.Program`) and, of those,
    tracing and lowering."""

    ids: jax.Array
    compile_seconds: float
    lower_seconds: float


def generate(
    model: CausalLM,
    input_ids: jax.Array | np.ndarray,
    max_new_tokens: int,
    attention_mask: jax.Array | np.ndarray | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    stop: Callable[[np.ndarray], bool] | None = None,
) -> jax.Array:
    """Greedy continuation of ``input_ids [b, s]``: ``[b, s + max_new_tokens]`` ids.

    ``attention_mask [b, s]`` (1 = token, 0 = padding; int or bool, numpy or jax) marks padding;
    batches are padded on the left, as for transformers. The prompt part, pad slots included, is
    returned unchanged. A row that emits an EOS token continues with ``pad_token_id``; once every
    row has, decoding stops and the rest is ``pad_token_id`` (transformers returns a shorter array
    there). ``eos_token_id``/``pad_token_id`` default to the checkpoint's ``config.json`` (pad: its
    ``pad_token_id``, else the first EOS id, as transformers does); without EOS ids every row runs
    ``max_new_tokens`` steps. Positions follow transformers: each real token's index among its
    row's real tokens, new tokens counting on from the last prompt position. ``stop`` is called
    after each step with the new tokens so far (``[b, t]`` numpy); when it returns True, decoding
    stops there (the rest is ``pad_token_id``, as after EOS): lm_eval's stop sequences. When the
    longest prompt (its real tokens) and ``max_new_tokens`` take more positions than the config's
    ``max_position_embeddings``, a ``ContextLengthWarning`` says so, and decoding goes on.
    """
    return _generate(model, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id, stop).ids


def timed_generate(model: CausalLM, input_ids: jax.Array | np.ndarray, max_new_tokens: int,
                   attention_mask: jax.Array | np.ndarray | None = None, *,
                   eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                   stop: Callable[[np.ndarray], bool] | None = None) -> Generated:
    """:func:`generate`, and the seconds spent getting its programs (a caller that splits its time
    into compiling and generating, as lm_eval's ``generate_until`` does)."""
    return _generate(model, input_ids, max_new_tokens, attention_mask, eos_token_id, pad_token_id, stop)


def _generate(model: CausalLM, input_ids: jax.Array | np.ndarray, max_new_tokens: int,
              attention_mask: jax.Array | np.ndarray | None, eos_token_id: int | Sequence[int] | None,
              pad_token_id: int | None, stop: Callable[[np.ndarray], bool] | None) -> Generated:
    """What :func:`generate` and :func:`timed_generate` do (called by them directly: a
    ``ContextLengthWarning`` names their caller's line)."""
    ids = np.asarray(input_ids)
    if ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq]; got shape {ids.shape}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0; got {max_new_tokens}")
    batch, seq = ids.shape
    mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {mask.shape}; expected {ids.shape} like input_ids")
    eos, pad = special_tokens(model, eos_token_id, pad_token_id)
    if max_new_tokens == 0:
        return Generated(jnp.asarray(ids), 0.0, 0.0)
    warn_past_context(model, int(mask.sum(axis=-1).max()), max_new_tokens)
    positions = np.where(mask, np.cumsum(mask, axis=-1) - 1, 0).astype(np.int32)
    mesh = model_mesh(model)
    serial = one_step_at_a_time(mesh)
    compile_seconds = lower_seconds = 0.0

    def run(*args: Any) -> tuple[jax.Array, KVCache, jax.Array]:
        nonlocal compile_seconds, lower_seconds
        program = _step.compile(*args, eos=eos, pad=pad, mesh=mesh)  # this process's after the first call
        compile_seconds += program.seconds
        lower_seconds += program.lower_seconds
        out: tuple[jax.Array, KVCache, jax.Array] = program.compiled(*args)
        return out

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        cache = model.init_cache(batch, seq + max_new_tokens)
        if mesh is not None:
            cache = jax.device_put(cache, cache_shardings(cache, mesh))
        token, cache, unfinished = run(model, ids, mask, positions, cache, jnp.ones((batch,), bool))
        new = [token]
        last = positions[:, -1:]
        for t in range(1, max_new_tokens):
            if eos and not bool(unfinished.any()):
                break
            if stop is not None and stop(np.concatenate([np.asarray(x) for x in new], axis=1)):
                break
            if serial:
                token.block_until_ready()
            token, cache, unfinished = run(model, token, np.ones((batch, 1), bool), last + t, cache, unfinished)
            new.append(token)
    out = np.full((batch, max_new_tokens), 0 if pad is None else pad, np.int32)
    out[:, : len(new)] = np.concatenate([np.asarray(t) for t in new], axis=1)
    return Generated(jnp.asarray(np.concatenate([ids.astype(np.int32), out], axis=1)), compile_seconds, lower_seconds)


def _decoding_step(
    model: CausalLM,
    tokens: jax.Array | np.ndarray,
    step_mask: np.ndarray,
    step_positions: np.ndarray,
    cache: KVCache,
    unfinished: jax.Array,
    *,
    eos: tuple[int, ...],
    pad: int | None,
    mesh: Mesh | None,
) -> tuple[jax.Array, KVCache, jax.Array]:
    """One decoding step (prefill or decode: two shapes, two programs): the next token of every
    row (``[b, 1]``: the next step's input as it is) and the updated cache."""
    logits, updated = model.run(tokens, step_mask, step_positions, cache, last_only=True)
    assert updated is not None  # run returns the cache it was given, updated
    cache = updated
    if mesh is not None:
        # jax leaves with_sharding_constraint unannotated (pytree in, same pytree out).
        cache = jax.lax.with_sharding_constraint(cache, cache_shardings(cache, mesh))  # type: ignore[no-untyped-call]
    nxt = jnp.argmax(logits[:, -1].astype(jnp.float32), axis=-1).astype(jnp.int32)
    if eos:
        assert pad is not None  # special_tokens falls back to the first EOS id
        nxt = jnp.where(unfinished, nxt, pad)
        unfinished = unfinished & ~jnp.isin(nxt, jnp.asarray(eos, jnp.int32))
    nxt = nxt[:, None]
    if mesh is not None:
        # The new tokens go back to the host every step: replicated, every process of a mesh
        # spanning several holds them all (a row-sharded array could not be read there).
        replicated = NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]  # jax: unannotated
        nxt, unfinished = (jax.lax.with_sharding_constraint(x, replicated)  # type: ignore[no-untyped-call]
                           for x in (nxt, unfinished))
    return nxt, cache, unfinished


# Compiled once per model structure, shape, special tokens and mesh, and kept across jobs
# (otfload.programs); the cache (argument 4) is updated in place.
_step = CachedJit(_decoding_step, static_argnames=("eos", "pad", "mesh"), donate_argnums=(4,))


def one_step_at_a_time(mesh: Mesh | None) -> bool:
    """Whether each decoding step waits for the last one's token before it is dispatched: on XLA:CPU
    a program over several devices deadlocks in its collectives when many of its runs are queued
    (seen with 8 host devices and 130 steps queued: "only 7 of 8 arrived" at an all-reduce, then
    an abort). Elsewhere the steps queue up and the host's dispatch overlaps the devices' work."""
    return mesh is not None and mesh.devices.size > 1 and mesh.devices.flat[0].platform == "cpu"


def config_with(model: CausalLM, key: str) -> dict[str, Any]:
    """The ``config.json`` a bundled model was built from, or its ``text_config`` (a multimodal
    checkpoint's) when ``key`` is only there; empty for a model otfload did not build."""
    origin = origin_of(model)
    config = origin.config if origin is not None else {}
    if key not in config and isinstance(config.get("text_config"), dict):
        return dict(config["text_config"])
    return dict(config)


def special_tokens(
    model: CausalLM, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None
) -> tuple[tuple[int, ...], int | None]:
    """``(eos ids, pad id)``: the arguments, else the model's ``config.json`` (its ``text_config``
    for multimodal checkpoints); pad falls back to the first EOS id, as in transformers."""
    config = config_with(model, "eos_token_id")
    if eos_token_id is None:
        eos_token_id = config.get("eos_token_id")
    eos = () if eos_token_id is None else tuple(np.atleast_1d(eos_token_id).astype(int).tolist())
    if pad_token_id is None:
        pad_token_id = config.get("pad_token_id")
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    return eos, pad_token_id


def warn_past_context(model: CausalLM, prompt_tokens: int, max_new_tokens: int) -> None:
    """Warn (``ContextLengthWarning``) when the longest prompt and the new tokens take more positions
    than the config's ``max_position_embeddings``: a rotary model runs there, but was never trained
    to, and what it generates past it is unreliable."""
    limit = config_with(model, "max_position_embeddings").get("max_position_embeddings")
    total = prompt_tokens + max_new_tokens
    if isinstance(limit, int) and total > limit:
        warnings.warn(f"a prompt of {prompt_tokens} tokens and {max_new_tokens} new tokens take {total} positions, "
                      f"more than the model's max_position_embeddings of {limit} (config.json): the tokens past "
                      f"position {limit} are generated beyond what the model was trained for",
                      ContextLengthWarning, stacklevel=4)  # the caller of generate/timed_generate


def model_mesh(model: nnx.Module) -> Mesh | None:
    """The mesh the model's parameters are sharded on (None for single-device arrays)."""
    for leaf in jax.tree.leaves(nnx.state(model, nnx.Param)):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            return sharding.mesh
    return None


def cache_shardings(cache: KVCache, mesh: Mesh) -> KVCache:
    """Each cache leaf's ``NamedSharding``: batch on the batch axes, kv heads on ``tp`` (by the
    default logical-axis rules; a dimension the mesh does not divide stays replicated)."""
    def sharding(path: tuple[Any, ...], leaf: jax.Array) -> NamedSharding:
        key = path[-1]
        assert isinstance(key, jax.tree_util.DictKey) and isinstance(key.key, str)  # nested dicts of arrays
        return logical_to_sharding(CACHE_AXES[key.key], leaf.shape, mesh)

    shardings: KVCache = jax.tree_util.tree_map_with_path(sharding, cache)
    return shardings
