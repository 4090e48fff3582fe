"""The Gated DeltaNet mixer's parts against numpy written from the recurrence's definition: the chunked
gated delta rule (several chunk sizes, a ragged last chunk, grouped value heads, an initial state),
the token-by-token form, the causal conv1d with its state, and a state carried across calls equal to
one call over the whole sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from otfload.models import gated_delta
from otfload.models.gated_delta import l2_normalize

# Jitted, as the models run them: one program per call's shapes where op-by-op dispatch compiled each
# small op (the chunked form's log2(chunk) doubling rounds, the scans) on its own.
causal_conv1d = jax.jit(gated_delta.causal_conv1d)
gated_delta_rule = jax.jit(gated_delta.gated_delta_rule, static_argnames="chunk")
recurrent_gated_delta_rule = jax.jit(gated_delta.recurrent_gated_delta_rule)


def numpy_delta_rule(q, k, v, g, beta, state):
    """``S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q`` per token, float64."""
    q, k, v, g, beta, s = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    out = np.zeros(v.shape)
    for t in range(q.shape[1]):
        s = s * np.exp(g[:, t])[..., None, None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", s, k[:, t])) * beta[:, t][..., None]
        s = s + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = np.einsum("bhkv,bhk->bhv", s, q[:, t])
    return out, s


def inputs(b=2, s=37, h=4, dk=8, dv=6, seed=0):
    rng = np.random.default_rng(seed)
    q = np.asarray(l2_normalize(jnp.asarray(rng.normal(size=(b, s, h, dk)), jnp.float32))) * dk**-0.5
    k = np.asarray(l2_normalize(jnp.asarray(rng.normal(size=(b, s, h, dk)), jnp.float32)))
    v = rng.normal(size=(b, s, h, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 1.5, size=(b, s, h)).astype(np.float32)
    beta = rng.uniform(0, 1, size=(b, s, h)).astype(np.float32)
    state = rng.normal(size=(b, h, dk, dv)).astype(np.float32)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("chunk", [1, 8, 16, 64])
def test_chunked_rule_matches_the_recurrence(chunk):
    q, k, v, g, beta, state = inputs()
    ref, ref_state = numpy_delta_rule(q, k, v, g, beta, state)
    out, final = gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta, state)), chunk=chunk)
    np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(final), ref_state, atol=2e-5, rtol=1e-4)
    assert out.dtype == jnp.float32


def test_token_by_token_form_and_zero_initial_state():
    q, k, v, g, beta, _ = inputs(s=20)
    zero = np.zeros((2, 4, 8, 6), np.float32)
    ref, ref_state = numpy_delta_rule(q, k, v, g, beta, zero)
    for out, final in (recurrent_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), None),
                       gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), None, chunk=8)):
        np.testing.assert_allclose(np.asarray(out), ref, atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(final), ref_state, atol=2e-5, rtol=1e-4)


def test_state_carried_across_calls_equals_one_call():
    q, k, v, g, beta, state = (jnp.asarray(x) for x in inputs(s=30))
    whole, whole_state = gated_delta_rule(q, k, v, g, beta, state, chunk=8)
    first, mid = gated_delta_rule(q[:, :13], k[:, :13], v[:, :13], g[:, :13], beta[:, :13], state, chunk=8)
    second, end = gated_delta_rule(q[:, 13:], k[:, 13:], v[:, 13:], g[:, 13:], beta[:, 13:], mid, chunk=8)
    np.testing.assert_allclose(np.concatenate([first, second], 1), whole, atol=1e-5)
    np.testing.assert_allclose(end, whole_state, atol=1e-5)


def test_zero_write_and_unit_decay_leave_the_state_alone():
    """What a pad token gets (beta 0, g 0): the state passes through unchanged."""
    q, k, v, g, beta, state = inputs(s=5)
    _, final = gated_delta_rule(*map(jnp.asarray, (q, k, v, np.zeros_like(g), np.zeros_like(beta), state)))
    np.testing.assert_allclose(np.asarray(final), state, atol=1e-6)


def test_causal_conv1d_with_its_state():
    rng = np.random.default_rng(1)
    b, s, c, taps = 2, 9, 5, 4
    x = rng.normal(size=(b, s, c)).astype(np.float32)
    w = rng.normal(size=(c, taps)).astype(np.float32)
    past = rng.normal(size=(b, c, taps)).astype(np.float32)
    seq = np.concatenate([past.transpose(0, 2, 1), x], 1)  # [b, K + s, c]
    ref = np.stack([sum(seq[:, taps + t - taps + 1 + j] * w[:, j] for j in range(taps)) for t in range(s)], 1)
    ref = ref / (1 + np.exp(-ref))
    y, state = causal_conv1d(jnp.asarray(x), jnp.asarray(w), jnp.asarray(past))
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(state), seq[:, -taps:].transpose(0, 2, 1))
    y0, _ = causal_conv1d(jnp.asarray(x), jnp.asarray(w), None)  # zeros before the sequence
    first, mid = causal_conv1d(jnp.asarray(x[:, :4]), jnp.asarray(w), None)
    rest, _ = causal_conv1d(jnp.asarray(x[:, 4:]), jnp.asarray(w), mid)
    np.testing.assert_allclose(np.concatenate([first, rest], 1), y0, atol=1e-6)
