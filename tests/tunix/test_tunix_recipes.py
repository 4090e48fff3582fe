"""The tunix recipes (``otfload.mappings.tunix_qwen3`` / ``tunix_gemma3``) against tunix itself
(google-tunix 0.1.7): for each tiny transformers model saved as a multi-shard safetensors
checkpoint, (a) tunix's own ``create_model_from_safe_tensors`` and (b) ``otfload.load_params`` given
the function building the same tunix module (``otfload.abstract_module`` makes it abstract; one
call, the fused Gemma3 k/v and q/k/v weights included) give every parameter bitwise equal, same
dtype and same sharding, and (c) tunix's forward pass on the otfload-loaded model gives
transformers' logits.

All on a 2x4 ``('fsdp', 'tp')`` mesh of the 8 simulated CPU devices (tests/conftest.py), with Auto
axes (tunix's forward breaks on Explicit ones). Tunix's default sharding splits heads over ``tp``,
so the tiny models have 8 query and 4 key/value heads (4 divides both).

tunix needs safetensors < 0.8, so these tests run in their own venv (docs/byo_model.md#tunix); the
main venv skips them:
``PYTHONPATH=. .venv-tunix/bin/python -m pytest -q tests/tunix``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tunix", reason="tunix is not installed (its own venv: see docs/byo_model.md#tunix)")

from flax import nnx  # noqa: E402
from tunix.models.gemma3 import model as gemma3_model  # noqa: E402
from tunix.models.gemma3 import params_safetensors as gemma3_params  # noqa: E402
from tunix.models.qwen3 import model as qwen3_model  # noqa: E402
from tunix.models.qwen3 import params as qwen3_params  # noqa: E402

import otfload  # noqa: E402
from otfload.mappings import tunix_gemma3, tunix_qwen3  # noqa: E402
from tests.helpers import max_rel_diff, randomize_, token_ids, torch_logits  # noqa: E402

VOCAB, EMBED, MLP, HEADS, KV_HEADS, HEAD_DIM = 128, 64, 128, 8, 4, 16
# tunix 0.1.7's Qwen3 attention ignores ModelConfig.rope_theta and always rotates with 1e6 (Qwen3's
# real value), so the transformers side must use it too.
QWEN3_ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}
COMMON = dict(vocab_size=VOCAB, hidden_size=EMBED, num_attention_heads=HEADS, head_dim=HEAD_DIM,
              max_position_embeddings=64)


def _qwen3(tied: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**COMMON, intermediate_size=MLP, num_hidden_layers=2,
                                        num_key_value_heads=KV_HEADS, tie_word_embeddings=tied,
                                        rope_parameters=QWEN3_ROPE))


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    # tunix renormalises the top-k routing weights: norm_topk_prob=True is the matching transformers model
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**COMMON, intermediate_size=MLP, moe_intermediate_size=32,
                                              num_hidden_layers=2, num_key_value_heads=KV_HEADS, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True, rope_parameters=QWEN3_ROPE))


def _gemma3(kv_heads: int):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # 6 layers: five sliding-window layers and one global, as tunix's GEMMA3_ATTENTION_PATTERN cycles;
    # query_pre_attn_scalar = head_dim is tunix's BY_ONE_OVER_SQRT_HEAD_DIM.
    return Gemma3ForCausalLM(Gemma3TextConfig(**COMMON, intermediate_size=MLP, num_hidden_layers=6,
                                              num_key_value_heads=kv_heads, query_pre_attn_scalar=HEAD_DIM,
                                              sliding_window=4))


def qwen3_config(tied: bool = False, experts: int | None = None) -> qwen3_model.ModelConfig:
    return qwen3_model.ModelConfig(
        num_layers=2, vocab_size=VOCAB, embed_dim=EMBED, hidden_dim=32 if experts else MLP, num_heads=HEADS,
        head_dim=HEAD_DIM, num_kv_heads=KV_HEADS, rope_theta=1_000_000, norm_eps=1e-6, use_tied_embedding=tied,
        num_experts=experts, num_experts_per_tok=2 if experts else None,
    )


def gemma3_config(kv_heads: int) -> gemma3_model.ModelConfig:
    # float32 params: tunix's loader keeps the checkpoint's float32 whatever param_dtype says
    return gemma3_model.ModelConfig(
        num_layers=6, num_embed=VOCAB, embed_dim=EMBED, hidden_dim=MLP, num_heads=HEADS, head_dim=HEAD_DIM,
        num_kv_heads=kv_heads, sliding_window_size=4, local_base_frequency=10_000,
        global_base_frequency=1_000_000, param_dtype=jnp.float32,
    )


CASES = {
    "qwen3": (lambda: _qwen3(False), lambda: qwen3_config()),
    "qwen3_tied": (lambda: _qwen3(True), lambda: qwen3_config(tied=True)),
    "qwen3_moe": (_qwen3_moe, lambda: qwen3_config(experts=8)),
    "gemma3": (lambda: _gemma3(KV_HEADS), lambda: gemma3_config(KV_HEADS)),  # q_einsum + kv_einsum
    "gemma3_mha": (lambda: _gemma3(HEADS), lambda: gemma3_config(HEADS)),  # qkv_einsum
}


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``checkpoint(kind) -> (dir, torch model)``: the tiny model saved in several shards, once."""
    import torch

    cache: dict = {}

    def get(kind: str):
        if kind not in cache:
            torch.manual_seed(0)
            model = CASES[kind][0]()
            randomize_(model)
            model = model.float().eval()
            path = tmp_path_factory.mktemp("tunix") / kind
            model.save_pretrained(path, max_shard_size="60KB")
            cache[kind] = (path, model)
        return cache[kind]

    return get


def load(path, module, config, table, mesh):
    """The recipe of docs/byo_model.md#tunix: one load_params given the function that builds the
    module (otfload.abstract_module makes it abstract, under the mesh)."""
    return otfload.load_params(path, lambda: module(config, rngs=nnx.Rngs(0)), table, mesh=mesh)


def params(model) -> dict:
    return {".".join(map(str, k)): v.get_value() for k, v in nnx.state(model, nnx.Param).flat_state()}


@pytest.mark.parametrize("kind", list(CASES))
def test_tunix_model_equals_tunix_loader_and_transformers(checkpoint, mesh, kind):
    path, torch_model = checkpoint(kind)
    config = CASES[kind][1]()
    if kind.startswith("qwen3"):
        ref = qwen3_params.create_model_from_safe_tensors(str(path), config, mesh=mesh)
        ours = load(path, qwen3_model.Qwen3, config, tunix_qwen3.TABLE, mesh)
    else:
        ref = gemma3_params.create_model_from_safe_tensors(str(path), config, mesh=mesh)
        ours = load(path, gemma3_model.Gemma3, config, tunix_gemma3.TABLE, mesh)

    theirs, mine = params(ref), params(ours)
    assert mine.keys() == theirs.keys()
    for name, want in theirs.items():
        got = mine[name]
        assert got.dtype == want.dtype, name
        assert got.sharding == want.sharding, name
        assert np.array_equal(np.asarray(got), np.asarray(want)), name
    if kind == "qwen3_moe":
        assert mine["layers.1.mlp.gate_proj"].shape == (8, EMBED, 32)
    if kind == "gemma3":
        assert mine["layers.0.attn.kv_einsum.w"].sharding.spec == jax.sharding.PartitionSpec(None, "tp", "fsdp", None)
    if kind == "gemma3_mha":
        assert mine["layers.0.attn.qkv_einsum.w"].shape == (3, HEADS, EMBED, HEAD_DIM)
    if kind.startswith("gemma3"):  # out_sharding=() on the 1-D norms: replicated
        assert mine["layers.0.attn._query_norm.scale"].sharding.is_fully_replicated

    ids = token_ids(vocab=VOCAB)
    batch, length = ids.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), bool)), (batch, length, length))
    logits, _ = ours(jnp.asarray(ids), positions, None, mask)
    assert max_rel_diff(np.asarray(logits), torch_logits(torch_model, ids)) <= 1e-4
