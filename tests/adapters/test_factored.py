"""LoRA factored (``merge_adapter=False``): logits equal ``peft.PeftModel``'s (f32, ≤ 1e-4 ×
max|logits|) and the merged load's, scanned and unscanned, on meshes that cut every matrix; the
gradient w.r.t. the factors equals PyTorch's on PEFT's ``lora_A``/``lora_B``; the adapter swaps on a
loaded base; ``export_adapter`` writes an adapter PEFT loads with the same logits."""

from __future__ import annotations

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.adapters.factored import factored_record
from otfload.adapters.weight import LoraWeight, lora_factors, with_lora_factors
from otfload.errors import AdapterError
from otfload.plan.sharding import make_mesh
from tests.adapters.support import ALL_PROJECTIONS, make_adapter, peft_logits
from tests.families.moe_helpers import MESHES
from tests.helpers import hf_tensors, jax_logits, max_rel_diff, token_ids, torch_logits

TOLERANCE = 1e-4
MIN_EFFECT = 1e-3  # the adapter must move the logits far more than the tolerance
DENSE = ["llama_patterns", "llama_bf16", "qwen3_all"]
MOE = ["qwen3_moe_per_expert", "mixtral_per_expert"]


@pytest.fixture(scope="module")
def adapters(peft_adapters, tiny_checkpoints, tmp_path_factory):
    """``peft_adapters`` plus Qwen3 adapters on every projection (two, for swapping)."""
    root = tmp_path_factory.mktemp("factored")

    def get(name: str):
        if name.startswith("qwen3_all"):
            path, torch_model = tiny_checkpoints("qwen3")
            seed = int(name.removeprefix("qwen3_all") or 0)
            return path, torch_model, [make_adapter(torch_model, root / name, seed=seed, r=4, lora_alpha=8,
                                                    target_modules=ALL_PROJECTIONS)]
        return peft_adapters(name)

    return get


def mesh_for(name: str):
    return make_mesh(MESHES["fsdp2_ep4"]) if name in MOE else make_mesh({"fsdp": 2, "tp": 4})


def factored_model(adapters, name: str, scan_layers: bool = True):
    path, torch_model, (adapter,) = adapters(name)
    model = otfload.from_pretrained(path, adapter=adapter, merge_adapter=False, mesh=mesh_for(name),
                                    scan_layers=scan_layers)
    return model, path, torch_model, adapter


# Every adapter once, scanned and unscanned alternating (dense and MoE each get both), and one both ways.
PARITY_CASES = [(name, i % 2 == 0) for i, name in enumerate(DENSE + MOE)] + [(DENSE[0], False)]


@pytest.mark.parametrize(("name", "scan_layers"), PARITY_CASES)
def test_factored_logits_match_peft_and_merged(adapters, name, scan_layers):
    model, path, torch_model, adapter = factored_model(adapters, name, scan_layers)
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    ours = jax_logits(model, ids)
    assert max_rel_diff(ours, reference) <= TOLERANCE
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > MIN_EFFECT
    merged = otfload.from_pretrained(path, adapter=adapter, mesh=mesh_for(name), scan_layers=scan_layers)
    assert max_rel_diff(ours, jax_logits(merged, ids)) <= TOLERANCE
    kept = [v for v in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, LoraWeight))
            if isinstance(v, LoraWeight)]
    assert kept, "no kernel was kept as a LoraWeight"


def test_factors_are_sharded_like_the_base(adapters):
    """q's kernel is ``[layers, heads, head_dim, hidden]``: b takes the heads/head_dim sharding,
    a the hidden one, the rank axis is replicated; the factor values are PEFT's, gathered by row."""
    model, _, _, adapter = factored_model(adapters, "qwen3_all")
    weight = model.layers.attn.q.kernel.get_value()
    assert isinstance(weight, LoraWeight)
    base_spec = tuple(weight.base.sharding.spec) + (None,) * (4 - len(weight.base.sharding.spec))
    assert tuple(weight.b.sharding.spec) == (*base_spec[:3], None)
    assert tuple(weight.a.sharding.spec) == (base_spec[0], None, base_spec[3])
    assert any(s is not None for s in base_spec[1:])  # the mesh really cuts the kernel
    a_hf = hf_tensors(adapter)["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    b_hf = hf_tensors(adapter)["base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"]
    np.testing.assert_array_equal(np.asarray(weight.a)[1], a_hf)  # A [r, hidden]: the kernel's input dims
    b = np.asarray(weight.b)[1]  # [heads, head_dim, r]
    np.testing.assert_array_equal(b.reshape(-1, b.shape[-1]), b_hf)


def loss_weights(shape) -> np.ndarray:
    return np.random.default_rng(7).standard_normal(shape).astype(np.float32)


def torch_factor_grads(torch_model, adapter, ids, modules) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """PyTorch gradients of ``sum(logits * w)`` w.r.t. PEFT's lora_A and lora_B of each of ``modules``
    (one forward and backward pass)."""
    import torch
    from peft import PeftModel

    peft = PeftModel.from_pretrained(copy.deepcopy(torch_model), adapter, is_trainable=True).eval()
    logits = peft(torch.as_tensor(ids)).logits
    (logits * torch.as_tensor(loss_weights(tuple(logits.shape)))).sum().backward()
    params = dict(peft.named_parameters())
    return {module: (params[f"base_model.model.{module}.lora_A.default.weight"].grad.numpy(),
                     params[f"base_model.model.{module}.lora_B.default.weight"].grad.numpy()) for module in modules}


@jax.jit
def weighted_logits_grads(model, ids: jax.Array, w: jax.Array):
    """The gradient of ``sum(logits * w)`` w.r.t. every Param of ``model``, compiled whole (one program a
    model structure) rather than run op by op."""
    return nnx.grad(lambda m: jnp.sum(m(ids) * w))(model)


# Scanned only: the factors' gradient has no scan-specific code (the unscanned forward's parity is
# test_factored_logits_match_peft_and_merged's), and scanned is from_pretrained's default.
def test_gradients_match_torch(adapters):
    model, _, torch_model, adapter = factored_model(adapters, "qwen3_all")
    ids = token_ids()
    w = jnp.asarray(loss_weights((*ids.shape, model.cfg.vocab_size)))
    grads = weighted_logits_grads(model, jnp.asarray(ids), w)
    modules = {"o": "model.layers.2.self_attn.o_proj", "q": "model.layers.2.self_attn.q_proj"}
    reference = torch_factor_grads(torch_model, adapter, ids, modules.values())
    for name, module in modules.items():
        grad = grads.layers.attn[name]["kernel"].get_value()
        g_a, g_b = np.asarray(grad.a)[2], np.asarray(grad.b)[2]  # layer 2 of the stack
        ref_a, ref_b = reference[module]
        leaf = factored_record(model).leaves[f"layers.attn.{name}.kernel"]
        ours_a = np.empty_like(ref_a)
        ours_a[:, leaf.a_index.ravel()] = g_a.reshape(g_a.shape[0], -1)
        ours_b = np.empty_like(ref_b)
        ours_b[leaf.b_index.ravel()] = g_b.reshape(-1, g_b.shape[-1])
        assert np.abs(ref_a).max() > 0 and np.abs(ref_b).max() > 0
        np.testing.assert_allclose(ours_a, ref_a, atol=1e-4 * np.abs(ref_a).max())
        np.testing.assert_allclose(ours_b, ref_b, atol=1e-4 * np.abs(ref_b).max())
    # The same gradients when only the factors are differentiated (no gradient of the base).
    graphdef, state = nnx.split(model)
    factors = lora_factors(state)
    only = jax.grad(lambda f: jnp.sum(nnx.merge(graphdef, with_lora_factors(state, f))(jnp.asarray(ids)) * w))(factors)
    full = lora_factors(grads)
    assert len(only) == len(full) == 7
    for mine, theirs in zip(only, full, strict=True):
        for key in ("a", "b"):
            np.testing.assert_allclose(np.asarray(mine[key]), np.asarray(theirs[key]), rtol=1e-5,
                                       atol=1e-6 * float(np.abs(np.asarray(theirs[key])).max()))


def sgd_step(model, ids: np.ndarray, lr: float = 0.2) -> None:
    """One gradient step on every kept factor (the base is left as it is), as training would."""
    w = jnp.asarray(loss_weights((*ids.shape, model.cfg.vocab_size)))
    grads = weighted_logits_grads(model, jnp.asarray(ids), w)
    is_lora = lambda x: isinstance(x, LoraWeight)  # noqa: E731

    def step(x, g):
        if not is_lora(x):
            return x
        return LoraWeight(x.base, x.a - lr * g.a / jnp.abs(g.a).max(), x.b - lr * g.b / jnp.abs(g.b).max(),
                          x.scale, x.layout)

    nnx.update(model, jax.tree.map(step, nnx.state(model, nnx.Param), grads, is_leaf=is_lora))


@pytest.mark.parametrize(("name", "scan_layers"), [("llama_patterns", True), ("qwen3_all", False)])
def test_export_adapter_loads_in_peft(adapters, tmp_path, name, scan_layers):
    import json

    model, _, torch_model, adapter = factored_model(adapters, name, scan_layers)
    ids = token_ids()
    before = jax_logits(model, ids)
    sgd_step(model, ids)
    ours = jax_logits(model, ids)
    assert max_rel_diff(ours, before) > MIN_EFFECT  # the export must carry the new factors
    out = otfload.export_adapter(model, tmp_path / "exported")
    assert max_rel_diff(peft_logits(torch_model, [out], ids), ours) <= TOLERANCE
    written, original = hf_tensors(out), hf_tensors(adapter)
    assert written.keys() == original.keys()
    assert all(written[k].shape == original[k].shape for k in written)
    config, source = json.loads((out / "adapter_config.json").read_text()), json.loads(
        (adapter / "adapter_config.json").read_text())
    for field in ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern"):
        assert config[field] == source[field], field
    with pytest.raises(otfload.OutputExistsError):
        otfload.export_adapter(model, out)


def test_export_refuses_factors_past_a_slice_rank(adapters, tmp_path):
    """llama_patterns gives layer 1's v_proj rank 2 in a rank-4 stack: its padding must stay zero."""
    model, _, _, _ = factored_model(adapters, "llama_patterns")
    weight = model.layers.attn.v.kernel.get_value()
    assert weight.rank == 4 and not np.asarray(weight.a)[1, 2:].any()
    model.layers.attn.v.kernel.set_value(LoraWeight(weight.base, weight.a + 0.01, weight.b, weight.scale,
                                                    weight.layout))
    with pytest.raises(AdapterError, match="rank 2"):
        otfload.export_adapter(model, tmp_path / "out")


def test_moe_per_expert_export_round_trip(adapters, tmp_path):
    """Per-expert factors (stacked over layers and experts) come back bit-exact."""
    model, _, _, adapter = factored_model(adapters, "qwen3_moe_per_expert")
    out = otfload.export_adapter(model, tmp_path / "exported")
    written, original = hf_tensors(out), hf_tensors(adapter)
    assert written.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(written[key], value)


def test_swap_adapters_on_one_base(adapters):
    path, torch_model, (first,) = adapters("qwen3_all")
    _, _, (second,) = adapters("qwen3_all1")
    ids = token_ids()
    model = otfload.from_pretrained(path, adapter=first, merge_adapter=False, mesh=make_mesh({"fsdp": 2, "tp": 4}))
    base = model.layers.attn.q.kernel.get_value().base
    otfload.load_adapter(model, second)
    assert model.layers.attn.q.kernel.get_value().base is base  # the base stays placed, untouched
    assert max_rel_diff(jax_logits(model, ids), peft_logits(torch_model, [second], ids)) <= TOLERANCE
    otfload.load_adapter(model, None)
    assert max_rel_diff(jax_logits(model, ids), torch_logits(torch_model, ids)) <= TOLERANCE
    assert not isinstance(model.layers.attn.q.kernel.get_value(), LoraWeight)


def test_swap_onto_a_base_loaded_without_adapter(adapters):
    path, torch_model, (adapter,) = adapters("qwen3_all")
    ids = token_ids()
    model = otfload.from_pretrained(path, merge_adapter=False, mesh=make_mesh({"fsdp": 2, "tp": 4}))
    otfload.load_adapter(model, adapter)
    assert max_rel_diff(jax_logits(model, ids), peft_logits(torch_model, [adapter], ids)) <= TOLERANCE


@pytest.mark.parametrize("name", ["llama_tied_embed", "qwen3_tied_head", "mixtral_fused", "llama_two"])
def test_what_cannot_be_factored_is_a_typed_error(adapters, name):
    path, _, dirs = adapters(name)
    with pytest.raises(AdapterError, match="merge"):
        otfload.from_pretrained(path, adapter=dirs if len(dirs) > 1 else dirs[0], merge_adapter=False,
                                mesh=mesh_for(name))


def test_factored_needs_a_factored_model_and_the_bundled_models(adapters, tmp_path):
    path, _, (adapter,) = adapters("qwen3_all")
    merged = otfload.from_pretrained(path, adapter=adapter, mesh=make_mesh({"fsdp": 8}))
    with pytest.raises(AdapterError, match="merge_adapter=False"):
        otfload.export_adapter(merged, tmp_path / "out")
    with pytest.raises(AdapterError, match="merge_adapter=False"):
        otfload.load_adapter(merged, adapter)
    plain = otfload.from_pretrained(path, merge_adapter=False, mesh=make_mesh({"fsdp": 8}))
    with pytest.raises(AdapterError, match="no LoRA"):
        otfload.export_adapter(plain, tmp_path / "out")
    with pytest.raises(AdapterError, match="bundled models"):
        otfload.load_params(path, {}, {}, adapter=adapter, merge_adapter=False)


@pytest.mark.parametrize("merge", [True, False])
def test_cli_load_with_adapter_verifies_against_peft(adapters, capsys, merge):
    from otfload.cli import main

    path, _, (adapter,) = adapters("qwen3_all")
    argv = ["load", str(path), "--adapter", str(adapter), "--mesh", "fsdp=2,tp=4", "--verify"]
    assert main(argv + ([] if merge else ["--no-merge-adapter"])) == 0
    out = capsys.readouterr().out
    assert re.search(r"verify: max relative difference vs transformers \S+ .*: ok", out), out
    assert ("adapter kept: LoRA factors on 7 leaves" in out) != merge


def test_generate_with_separate_factors_equals_merged(adapters):
    """Decoding with a KV cache runs the layers through the same materialize: same tokens as merged."""
    path, _, (adapter,) = adapters("qwen3_all")
    mesh = make_mesh({"fsdp": 2, "tp": 4})
    ids = token_ids(seq=6)
    factored = otfload.from_pretrained(path, adapter=adapter, merge_adapter=False, mesh=mesh)
    merged = otfload.from_pretrained(path, adapter=adapter, mesh=mesh)
    out = np.asarray(otfload.generate(factored, ids, 6))
    np.testing.assert_array_equal(out, np.asarray(otfload.generate(merged, ids, 6)))
    assert out.shape == (2, 12)
