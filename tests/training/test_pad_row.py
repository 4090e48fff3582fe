"""The pad token's embedding row trains as transformers trains it: ``nn.Embedding(padding_idx=
pad_token_id)`` gives the row no gradient from the lookup; ``model.freeze_pad_row = False`` trains
it like any other row (PyTorch's ``padding_idx=None``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.families.registry import family_for
from tests.helpers import BASE
from tests.training.test_gradients import DENSE_MESH, PAD, batch, next_token_loss, torch_loss_and_grads, with_pad_id


def _config(name: str, **kw) -> dict:
    import transformers

    return getattr(transformers, name)(**{**BASE, **kw}).to_dict()


@pytest.mark.parametrize("pad", [PAD, -1, -256, 0])
@pytest.mark.parametrize("name", ["LlamaConfig", "Gemma2Config", "DeepseekV3Config", "GptOssConfig"])
def test_pad_token_id_is_the_row_pytorch_pads(name, pad):
    import torch

    config = _config(name, pad_token_id=pad)
    cfg = family_for(config).parse_config(config)
    assert cfg.pad_token_id == torch.nn.Embedding(BASE["vocab_size"], 4, padding_idx=pad).padding_idx


@pytest.mark.parametrize("name", ["LlamaConfig", "Gemma2Config", "Gemma3TextConfig", "Qwen3MoeConfig"])
def test_absent_null_or_outside_pad_token_id(name):
    """Absent: transformers' config default (Gemma 0, the others None); null or an id outside the
    vocabulary (never an input): no pad row."""
    import transformers

    config = _config(name)
    del config["pad_token_id"]
    family = family_for(config)
    assert family.parse_config(config).pad_token_id == getattr(transformers, name)().pad_token_id
    for pad in (None, BASE["vocab_size"]):
        assert family.parse_config({**config, "pad_token_id": pad}).pad_token_id is None


@pytest.mark.parametrize("freeze", [True, False])
def test_freeze_pad_row_switch(tiny_checkpoints, tmp_path, freeze):
    src, torch_model = tiny_checkpoints("llama")  # untied: the pad row's only use is the lookup
    path = with_pad_id(src, tmp_path / "ckpt")
    mesh = otfload.plan.sharding.make_mesh(DENSE_MESH)
    model = otfload.from_pretrained(path, mesh=mesh)
    model.freeze_pad_row = freeze
    ids = batch()
    with jax.set_mesh(mesh):
        _, grads = nnx.jit(nnx.value_and_grad(next_token_loss))(model, jnp.asarray(ids))
    ours = np.asarray(grads["embed"]["embedding"][...])
    _, ref = torch_loss_and_grads(torch_model, ids, PAD if freeze else None, tmp_path / "torch")
    ref = ref["model.embed_tokens.weight"]
    assert np.any(ref[PAD]) != freeze
    np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
