"""Padded batches as eval jobs send them: ``model(ids, attention_mask=mask, positions=None)``.

Every family, left and right padding, scanned (and unscanned where that takes other paths): real
tokens' logits equal transformers' ``model(ids, attention_mask=mask).logits`` and the model's own
logits of the unpadded sequence (padding changes nothing), within the 1e-4 f32 parity bound."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import otfload
from tests.helpers import max_rel_diff, torch_logits
from tests.models.kinds import KINDS, REAL, padded_batch, torch_masked_logits

# One jitted function for the module: left and right padding (the same input types) share one program.
_MASKED_FORWARD = jax.jit(lambda m, i, a, p: m(i, attention_mask=a, positions=p))


def _masked_logits(model, ids, mask, positions=None) -> np.ndarray:
    return np.asarray(_MASKED_FORWARD(model, ids, mask, positions))


# Unscanned layers take other code paths where a family has per-layer attention types (static
# windows, per-type RoPE) or layer groups; the rest share them with the scanned case.
UNSCANNED = ["mistral", "qwen3_moe", "gpt_oss", "gemma3_text", "deepseek_v2"]


@pytest.mark.parametrize(("kind", "scan_layers"), [(k, True) for k in KINDS] + [(k, False) for k in UNSCANNED])
def test_padding_changes_no_real_token_and_matches_transformers(tiny_checkpoints, mesh_2x4, kind, scan_layers):
    path, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers)
    alone = torch_logits(torch_model, padded_batch("left")[2][None])[0]  # the unpadded sequence (both sides')
    with jax.set_mesh(mesh_2x4):
        for side in ("left", "right"):
            ids, mask, _ = padded_batch(side)
            ours = _masked_logits(model, ids, mask)  # both sides: one program
            real = mask.astype(bool)
            ref = torch_masked_logits(torch_model, ids, mask)
            diff = max_rel_diff(ours[real], ref[real])
            assert diff <= 1e-4, (side, diff)
            for row, n in enumerate(REAL):
                diff = max_rel_diff(ours[row][real[row]], alone[:n])
                assert diff <= 1e-4, (side, row, diff)


def test_jax_ids_with_a_bool_mask_equal_transformers(tiny_checkpoints, mesh_2x4):
    """Every family reads the mask through one ``make_context``: a bool mask on jax ids (the other
    tests send numpy ids with an int mask) gives transformers' logits, checked here once."""
    path, torch_model = tiny_checkpoints("llama")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask, _ = padded_batch("right")
    ours = _masked_logits(model, jnp.asarray(ids), jnp.asarray(mask, bool))
    real = mask.astype(bool)
    assert max_rel_diff(ours[real], torch_masked_logits(torch_model, ids, mask)[real]) <= 1e-4


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "deepseek_v3", "gpt_oss"])
def test_given_positions_are_used_gaps_included(tiny_checkpoints, mesh_2x4, kind):
    """``positions`` is HF's ``position_ids``: used as given, gaps allowed (and it matters)."""
    path, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask, _ = padded_batch("left")
    gaps = np.cumsum(np.where(mask, 1 + np.arange(ids.shape[1]) % 3, 0), axis=-1)  # steps of 1, 2, 3
    ours = _masked_logits(model, ids, mask, gaps)
    real = mask.astype(bool)
    ref = torch_masked_logits(torch_model, ids, mask, gaps)
    assert max_rel_diff(ours[real], ref[real]) <= 1e-4
    default = _masked_logits(model, ids, mask)
    assert max_rel_diff(default[real], ref[real]) > 1e-3  # default positions differ from these


def test_mask_of_wrong_shape_is_an_error(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask, _ = padded_batch("left")
    with pytest.raises(ValueError, match="attention_mask has shape"):
        model(ids, attention_mask=mask[:, 1:])
