"""The shipped mapping tables as runnable recipes: each client model (examples/) loaded with
load_params from a transformers checkpoint gives transformers' logits, on a 2x4 mesh."""

import json
import runpy
from pathlib import Path

import jax
import numpy as np
import pytest

import otfload
from otfload.mappings import linen_llama, pytree_llama
from otfload.plan.abstract import dotted
from tests.helpers import hf_tensors, max_rel_diff, token_ids, torch_logits

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> dict:
    return runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="example")


def config_of(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_linen_llama_logits_match_transformers(tiny_checkpoints, mesh_2x4, kind):
    path, torch_model = tiny_checkpoints(kind)
    config = config_of(path)
    abstract = linen_llama.abstract_params(config, mesh_2x4)
    params = otfload.load_params(path, abstract, linen_llama.TABLE)
    q = params["params"]["decoder"]["layers"]["self_attention"]["query"]["kernel"]
    assert q.shape == (3, 64, 4, 16) and q.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tp")
    forward = example("linen_llama")["forward"]
    ids = token_ids()
    ours = jax.jit(lambda p, x: forward(p, x, config))(params, ids)
    assert max_rel_diff(ours, torch_logits(torch_model, ids)) <= 1e-4


def test_linen_llama_transposes_exactly_scanned_or_not(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    config, hf = config_of(path), hf_tensors(path)
    scanned = otfload.load_params(path, linen_llama.abstract_params(config, mesh_2x4), linen_llama.TABLE)
    unscanned = otfload.load_params(path, linen_llama.abstract_params(config, mesh_2x4, scan_layers=False),
                                    linen_llama.TABLE)
    wo = np.asarray(scanned["params"]["decoder"]["layers"]["mlp"]["wo"]["kernel"])
    np.testing.assert_array_equal(wo, np.stack([hf[f"model.layers.{i}.mlp.down_proj.weight"].T for i in range(3)]))
    for i in range(3):
        layer = unscanned["params"]["decoder"]["layers"][str(i)]
        np.testing.assert_array_equal(np.asarray(layer["self_attention"]["out"]["kernel"]),
                                      hf[f"model.layers.{i}.self_attn.o_proj.weight"].T.reshape(4, 16, 64))


@pytest.mark.parametrize("kind", ["llama", "llama_tied"])
def test_pytree_llama_dataclass_model_logits_match_transformers(tiny_checkpoints, mesh_2x4, kind):
    path, torch_model = tiny_checkpoints(kind)
    config = config_of(path)
    client = example("pytree_llama")
    model = otfload.load_params(path, client["abstract_model"](config, mesh_2x4), pytree_llama.TABLE)
    assert type(model).__name__ == "Llama" and len(model.layers) == 3  # the user's own classes come back
    assert model.layers[1].mlp.down_proj.weight.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    ids = token_ids()
    ours = jax.jit(lambda m, x: client["forward"](m, x, config))(model, ids)
    assert max_rel_diff(ours, torch_logits(torch_model, ids)) <= 1e-4


def test_pytree_llama_nested_dicts_read_every_tensor_once(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("llama")
    tree, report = otfload.load_params(path, pytree_llama.abstract_params(config_of(path), mesh_2x4),
                                       pytree_llama.TABLE, return_report=True, strict=True)
    hf = hf_tensors(path)
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert len(leaves) == len(hf)
    for key_path, leaf in leaves:
        name = dotted(key_path)
        np.testing.assert_array_equal(np.asarray(leaf), hf[name if name == "lm_head.weight" else f"model.{name}"])
    assert report.bytes_read == report.bytes_planned
