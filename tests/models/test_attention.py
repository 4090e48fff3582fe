"""The attention kernel against a direct numpy transcription of transformers' eager attention
(repeated KV heads, full ``[b, h, q, k]`` float64 logits), and its memory growth."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from otfload.models.attention import CHUNKED, DPA, Q_CHUNK, Context, attention

B, HEADS, KV_HEADS, DIM = 2, 4, 2, 8


def _reference(q, k, v, q_index, kv_mask, scale, window=None, softcap=None, sinks=None, more=None) -> np.ndarray:
    """``more [b, q, k]``: a further mask (packed rows' branches)."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = np.repeat(k, groups, axis=2), np.repeat(v, groups, axis=2)
    logits = np.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        logits = np.tanh(logits / softcap) * softcap
    j = np.arange(k.shape[1])[None, :]
    i = np.asarray(q_index)[:, None]
    visible = (j <= i) & ((i - j < window) if window else True)
    visible = visible[None, None] & np.asarray(kv_mask)[:, None, None, :] & (True if more is None else more[:, None])
    logits = np.where(visible, logits, -1e30)
    if sinks is not None:
        logits = np.concatenate([logits, np.broadcast_to(np.asarray(sinks)[None, :, None, None],
                                                         (*logits.shape[:-1], 1))], axis=-1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs = (probs / probs.sum(-1, keepdims=True))[..., : k.shape[1]]
    return np.einsum("bhqk,bkhd->bqhd", probs, v)


@functools.partial(jax.jit, static_argnames=("impl", "scale", "window", "softcap", "q_chunk"))
def _attention(q, k, v, q_index, kv_mask, *, impl, scale, window=None, softcap=None, sinks=None, q_chunk=Q_CHUNK,
               segments=None, prefixes=None):
    """:func:`attention` jitted, as the models run it (one program per case, not one per op), on the
    context of ``q_index``, ``kv_mask``, ``impl`` and the packed row's ``segments``/``prefixes``."""
    ctx = Context(positions=None, q_index=q_index, kv_mask=kv_mask, attention_impl=impl, segments=segments,
                  prefixes=prefixes)
    return attention(q, k, v, ctx, scale=scale, window=window, softcap=softcap, sinks=sinks, q_chunk=q_chunk)


def _inputs(queries: int, slots: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, queries, HEADS, DIM)).astype(np.float32)
    k = rng.normal(size=(B, slots, KV_HEADS, DIM)).astype(np.float32)
    v = rng.normal(size=(B, slots, KV_HEADS, DIM)).astype(np.float32)
    kv_mask = np.ones((B, slots), bool)
    kv_mask[1, :3] = False  # row 1: three left pad slots
    return q, k, v, kv_mask


CASES = {
    "causal": {},
    "window": {"window": 5},
    "softcap_sinks": {"softcap": 2.0, "sinks": np.linspace(-1, 1, HEADS).astype(np.float32)},
    "window_sinks": {"window": 3, "sinks": np.linspace(-1, 1, HEADS).astype(np.float32)},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("offset", [0, 9], ids=["prefill", "cached"])
def test_chunked_attention_matches_the_eager_formula(case, offset):
    """Chunks of 4 queries (windows then slice the keys) over 20 slots; ``offset`` puts the queries
    after 9 cached slots, as a decoding call does. A traced window gives the same result."""
    q, k, v, kv_mask = _inputs(queries=20 - offset, slots=20)
    q_index = offset + np.arange(q.shape[1])
    ctx = Context(positions=None, q_index=jnp.asarray(q_index), kv_mask=jnp.asarray(kv_mask), attention_impl=CHUNKED)
    kw = CASES[case]
    ref = _reference(q, k, v, q_index, kv_mask, 0.3, **kw)
    real = np.ones(ref.shape[:2], bool)
    real[1, : max(0, 3 - offset)] = False  # queries on pad slots see nothing: their output is unused
    for chunk in (4, 64):
        got = np.asarray(_attention(q, k, v, ctx.q_index, ctx.kv_mask, impl=CHUNKED, scale=0.3, q_chunk=chunk, **kw))
        np.testing.assert_allclose(got[real], ref[real], atol=2e-6)
    if "window" in kw:
        traced = jax.jit(lambda w: attention(q, k, v, ctx, scale=0.3, q_chunk=4, **{**kw, "window": w}))
        np.testing.assert_allclose(np.asarray(traced(kw["window"]))[real], ref[real], atol=2e-6)


@pytest.mark.parametrize("window", [None, 5])
def test_dot_product_attention_path_matches(window):
    q, k, v, kv_mask = _inputs(queries=12, slots=12)
    q_index = np.arange(12)
    got = np.asarray(_attention(q, k, v, q_index, kv_mask, impl=DPA, scale=0.3, window=window))
    ref = _reference(q, k, v, q_index, kv_mask, 0.3, window=window)
    real = np.ones(ref.shape[:2], bool)
    real[1, :3] = False
    np.testing.assert_allclose(got[real], ref[real], atol=2e-6)


# A packed row: a 5-slot prefix (segment 1), its branches 2 (4 slots) and 3 (3 slots), a sequence
# alone (segment 4, 3 slots), 3 padding slots.
SEGMENTS = np.array([1] * 5 + [2] * 4 + [3] * 3 + [4] * 3 + [0] * 3)
PREFIXES = np.array([1] * 5 + [1] * 4 + [1] * 3 + [4] * 3 + [0] * 3)
REAL = 15


@pytest.mark.parametrize("impl", [CHUNKED, DPA])
@pytest.mark.parametrize("window", [None, 3, 20], ids=["full", "window-slices-keys", "window-wider-than-row"])
def test_packed_sequences_see_their_prefix_and_their_own_earlier_tokens(impl, window):
    """``segments``/``prefixes``: a query sees keys of its own segment and of its prefix only, on
    top of the causal, window and padding masks; where no key is outside the window, each branch
    computes what the prefix followed by that branch alone does, and the sequence alone what it
    does in a row of its own."""
    slots = len(SEGMENTS)
    q, k, v, kv_mask = _inputs(queries=slots, slots=slots)
    kv_mask[:] = np.arange(slots) < REAL  # both rows: right padding
    segments = tuple(jnp.asarray(np.broadcast_to(a, (B, slots))) for a in (SEGMENTS, PREFIXES))
    got = np.asarray(_attention(q, k, v, jnp.arange(slots), jnp.asarray(kv_mask), impl=impl, scale=0.3, window=window,
                                q_chunk=4, segments=segments[0], prefixes=segments[1]))
    same = (SEGMENTS[None, :] == SEGMENTS[:, None]) | (SEGMENTS[None, :] == PREFIXES[:, None])
    more = np.broadcast_to(same, (B, slots, slots))
    ref = _reference(q, k, v, np.arange(slots), kv_mask, 0.3, window=window, more=more)
    np.testing.assert_allclose(got[:, :REAL], ref[:, :REAL], atol=2e-6)
    if window != 3:
        for own in ((1, 2), (1, 3), (4,)):
            keep = np.flatnonzero(np.isin(SEGMENTS, own))
            alone = _reference(q[:, keep], k[:, keep], v[:, keep], np.arange(len(keep)), np.ones((B, len(keep)), bool),
                               0.3)
            np.testing.assert_allclose(got[:, keep], alone, atol=2e-6)


def _temp_bytes(seq: int, window: int | None = None) -> int:
    q = jax.ShapeDtypeStruct((1, seq, HEADS, DIM), jnp.float32)
    kv = jax.ShapeDtypeStruct((1, seq, KV_HEADS, DIM), jnp.float32)

    def fn(q, k, v):
        ctx = Context(positions=None, q_index=jnp.arange(seq), kv_mask=None, attention_impl=CHUNKED)
        return attention(q, k, v, ctx, scale=0.3, window=window, q_chunk=128)

    return jax.jit(fn).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


def test_memory_grows_linearly_with_the_sequence():
    """Doubling the sequence at most ~doubles the scratch memory (quadratic logits would quadruple
    it: 4096² f32 logits per head are 64 MiB)."""
    small, large = _temp_bytes(2048), _temp_bytes(4096)
    assert large <= 2.3 * small, (small, large)
    assert large < 4096 * 4096 * 4  # below the full f32 logits of a single head
