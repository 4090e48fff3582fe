"""Training as loaded: every family's gradients equal PyTorch autograd's on the transformers model.

Each tiny checkpoint (the family tests' fixtures) gets a ``pad_token_id`` that occurs in the batch;
otfload loads it in float32 on 8 CPU devices (``fsdp=2 x tp=4``, MoE ``fsdp=2 x ep=4``) with its
default implementations (MoE: the ``"blocks"`` route), one ``nnx.jit`` AdamW step computes the
next-token cross-entropy and its gradient, and the gradient, exported to HF tensor names by the
family's mapping table run backwards (:func:`otfload.export_hf`), is compared per tensor with
``param.grad`` of the transformers model (``padding_idx=pad_token_id``, as transformers builds it).
The loss after the step (one forward pass) shows the step lowered it.
"""

import copy
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import otfload
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, max_rel_diff
from tests.models.kinds import KINDS

MOE = {"mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3"}
DENSE_MESH, MOE_MESH = {"fsdp": 2, "tp": 4}, {"fsdp": 2, "ep": 4}
# One scan mode per family: the gradient is JAX's reverse mode of the forward pass and no model code
# is specific to either mode's backward pass, so both modes' forward parity (each family's tests, in
# tests/families/) and one step per family here cover both. Unscanned where that takes other paths
# (per-layer attention types, layer groups: static windows, per-type RoPE, Qwen3-MoE's mixed layers;
# DeepSeek-V3's unscanned routed experts on ep), scanned for the rest (DeepSeek-V2: scanned MLA groups on ep).
UNSCANNED = ["mistral", "qwen3_moe", "gpt_oss", "gemma3_text", "deepseek_v3"]
CASES = [(k, k not in UNSCANNED) for k in KINDS]
PAD = 7
# The project's float32 parity bar (max |ours - torch| / max |torch|), per gradient tensor.
GRAD_TOL = 1e-4
LEARNING_RATE = 1e-2


def batch() -> np.ndarray:
    """Two rows of 12 tokens; the pad id occurs in the middle of one row and ends the other."""
    ids = np.random.default_rng(0).integers(8, 256, (2, 12))
    ids[0, 4], ids[1, -3:] = PAD, PAD
    return ids


def next_token_loss(model, ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of each position's logits against the next token."""
    logits = model(ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


@nnx.jit
def train_step(model, optimizer, ids):
    loss, grads = nnx.value_and_grad(next_token_loss)(model, ids)
    optimizer.update(model, grads)
    return loss, grads


def torch_loss_and_grads(torch_model, ids: np.ndarray, padding_idx: int | None, out) -> tuple[float, dict]:
    """transformers' loss and gradients, with the embedding's ``padding_idx`` set, the logits in at
    least float32. The gradients are named as checkpoint tensors by transformers itself: they replace
    the weights (buffers, and parameters no gradient reaches, such as an indexer run under
    ``torch.no_grad``, become zeros) and ``save_pretrained`` writes them (transformers 5 keeps some
    experts fused in memory, per expert on disk)."""
    import torch

    model = copy.deepcopy(torch_model)
    model.get_input_embeddings().padding_idx = padding_idx
    logits = model(torch.tensor(ids[:, :-1])).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.tensor(ids[:, 1:]).reshape(-1))
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.zeros_like(p) if p.grad is None else p.grad)
        for b in model.buffers():
            b.zero_()
    model.save_pretrained(out)
    return float(loss.detach()), hf_tensors(out)


def with_pad_id(src, dst):
    """A copy of checkpoint ``src`` whose ``config.json`` names :data:`PAD` its ``pad_token_id``."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "pad_token_id": PAD}))
    return dst


def exported_grads(grads, reference, out) -> dict[str, np.ndarray]:
    """The gradient pytree under HF tensor names (the mapping's inverse is linear)."""
    otfload.export_hf(nnx.to_pure_dict(grads), out, reference=reference)
    return hf_tensors(out)


def adamw_step(tiny_checkpoints, tmp_path, kind: str, mesh, scan_layers: bool, loss_after: bool = True):
    """``kind``'s checkpoint with :data:`PAD` as its pad id, loaded in float32 on ``mesh``, and one AdamW
    step on :func:`batch`: ``(model, checkpoint, ids, loss, grads, loss after the step)``. The loss after
    (None unless ``loss_after``) is one forward pass: a second step would compile the whole step again,
    as the step returns the norm scales sharded (``P(None, 'fsdp')``) where the load placed them replicated."""
    src, _ = tiny_checkpoints(kind)
    path = with_pad_id(src, tmp_path / "ckpt")
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype=jnp.float32)
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = train_step(model, optimizer, jnp.asarray(ids))
        after = nnx.jit(next_token_loss)(model, jnp.asarray(ids)) if loss_after else None
    return model, path, ids, loss, grads, after


def assert_grads_match(ours: dict, ref: dict) -> None:
    """The same tensors, each gradient within :data:`GRAD_TOL`; one torch keeps as a buffer
    (DeepSeek-V3's ``e_score_correction_bias``: it only picks experts) gets none here either."""
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for key, grad in ours.items():
        if key.endswith("e_score_correction_bias"):
            assert not np.any(grad) and not np.any(ref[key]), key
            continue
        assert np.abs(ref[key]).max() > 0, key  # every parameter gets a gradient in this batch
        diff = max_rel_diff(grad, ref[key])
        assert diff <= GRAD_TOL, (key, diff)


def check_step(tiny_checkpoints, tmp_path, kind: str, mesh, scan_layers: bool, match=assert_grads_match,
               pad_row: bool = True) -> None:
    """One AdamW step (:func:`adamw_step`): its loss and, by ``match``, every gradient equal
    transformers'; where the embedding is untied (and ``pad_row``) the pad id's row gets none, as its
    only use is the lookup; the step lowers the loss."""
    model, path, ids, loss, grads, after = adamw_step(tiny_checkpoints, tmp_path, kind, mesh, scan_layers)
    ref_loss, ref_grads = torch_loss_and_grads(tiny_checkpoints(kind)[1], ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    ours = exported_grads(grads, path, tmp_path / "grads")
    match(ours, ref_grads)
    embed = "model.embed_tokens.weight"
    if pad_row and not model.cfg.tie_word_embeddings:
        assert not np.any(ours[embed][PAD]) and np.any(ours[embed][ids[0, 0]])
    assert float(after) < float(loss)


@pytest.mark.parametrize(("kind", "scan_layers"), CASES)
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    check_step(tiny_checkpoints, tmp_path, kind, make_mesh(MOE_MESH if kind in MOE else DENSE_MESH), scan_layers)


@pytest.mark.parametrize("kind", ["deepseek_v3", "gpt_oss"])
def test_expert_parallel_ragged_gradient_taken_eagerly(tiny_checkpoints, tmp_path, kind):
    """An un-jitted ``nnx.value_and_grad`` through the experts' ``shard_map`` over ``ep`` with the
    GPU/TPU default ``"ragged"`` route (DeepSeek's shared experts, GPT-OSS's biases and sinks beside
    it) runs and equals PyTorch's gradient."""
    src, torch_model = tiny_checkpoints(kind)
    path = with_pad_id(src, tmp_path / "ckpt")
    mesh = make_mesh(MOE_MESH)
    model = otfload.from_pretrained(path, mesh=mesh, dtype=jnp.float32)
    model.moe_impl = "ragged"
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = nnx.value_and_grad(next_token_loss)(model, jnp.asarray(ids))
    ref_loss, ref_grads = torch_loss_and_grads(torch_model, ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_grads_match(exported_grads(grads, path, tmp_path / "grads"), ref_grads)
