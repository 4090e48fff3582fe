"""Bad input to ``otfload.maxtext``, refused before any tensor byte is read as a ``ConfigError``
naming the MaxText field and the otfload table: a model with no table, a layout or vocabulary
padding the tree or checkpoint does not fit, a tree or checkpoint of another model."""

from __future__ import annotations

import types

import pytest

import otfload.maxtext as mx
from otfload.errors import ConfigError
from otfload.plan.sharding import make_mesh
from tests.maxtext_tables.support import maxtext_config


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


@pytest.fixture
def no_reads(monkeypatch):
    """Fail the test if any tensor byte is read (the checks come first)."""
    from otfload.place import loader

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor was read")

    monkeypatch.setattr(loader, "execute_plan", refuse)


def refused(path, abstract, cfg, field: str, *words: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        mx.load_state(str(path), abstract, cfg)
    assert info.value.field == field, info.value
    for word in words:
        assert word in str(info.value), info.value
    return info.value


def test_model_without_a_table_names_model_name_and_the_tables(tiny_checkpoints, mesh):
    path, _ = tiny_checkpoints("mt_llama")
    cfg = maxtext_config("mt_llama", True, 1)
    abstract = mx.abstract_params(cfg, mesh)
    refused(path, abstract, {**cfg, "model_name": "gpt3-175b"}, "model_name", "gpt3-175b", "llama3.1-8b")


def test_missing_field_is_named(tiny_checkpoints, mesh):
    path, _ = tiny_checkpoints("mt_llama")
    cfg = maxtext_config("mt_llama", True, 1)
    abstract = mx.abstract_params(cfg, mesh)
    refused(path, abstract, {k: v for k, v in cfg.items() if k != "head_dim"}, "head_dim", "missing")


def test_param_scan_axis_the_tree_does_not_have(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_mixtral")
    abstract = mx.abstract_params(maxtext_config("mt_mixtral", True, 0), mesh)
    refused(path, abstract, maxtext_config("mt_mixtral", True, 1), "param_scan_axis", "'mixtral'",
            "param_scan_axis 1", "dimension 1")


def test_scan_layers_the_tree_does_not_have(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_llama")
    abstract = mx.abstract_params(maxtext_config("mt_llama", False, 1), mesh)
    refused(path, abstract, maxtext_config("mt_llama", True, 1), "scan_layers", "decoder.layers_", "'llama3.1'")


def test_vocab_size_smaller_than_the_checkpoints(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_llama")
    cfg = maxtext_config("mt_llama", True, 1, vocab_size=128)
    refused(path, mx.abstract_params(cfg, mesh), cfg, "vocab_size", "256", "never cuts")


def test_vocab_size_the_tree_is_not_padded_to(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_llama")
    abstract = mx.abstract_params(maxtext_config("mt_llama", True, 1), mesh)
    refused(path, abstract, maxtext_config("mt_llama", True, 1, vocab_size=320), "vocab_size",
            "token_embedder.embedding", "(256, 64)")


def test_tree_of_another_model(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_llama")
    abstract = mx.abstract_params(maxtext_config("mt_qwen3", True, 1), mesh)  # q/k norms: no Llama leaves
    cfg = maxtext_config("mt_llama", True, 1)
    refused(path, abstract, cfg, "model_name", "query_norm", "'llama3.1'")


def test_checkpoint_of_another_model(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_qwen3")
    cfg = maxtext_config("mt_llama", True, 1)
    refused(path, mx.abstract_params(cfg, mesh), cfg, "model_name", "model_type 'qwen3'", "['llama']")


def test_logits_via_embedding_the_tree_contradicts(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_llama")
    abstract = mx.abstract_params(maxtext_config("mt_llama", True, 1), mesh)
    refused(path, abstract, maxtext_config("mt_llama", True, 1, logits_via_embedding=True),
            "logits_via_embedding", "decoder.logits_dense.kernel")


def test_attribute_config_as_maxtext_passes_it(tiny_checkpoints, mesh):
    cfg = maxtext_config("mt_llama", False, 1)
    selection = mx.select(types.SimpleNamespace(**cfg))
    assert selection.table.name == "llama3.1" and not selection.scan_layers
    with pytest.raises(ConfigError, match="scan_layers"):
        mx.select(types.SimpleNamespace(**{**cfg, "scan_layers": "yes"}))


def test_unscanned_tree_with_other_layer_count(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_llama")
    abstract = mx.abstract_params(maxtext_config("mt_llama", False, 1, num_decoder_layers=2), mesh)
    refused(path, abstract, maxtext_config("mt_llama", False, 1), "num_decoder_layers", "[0, 1]")


def test_deepseek_param_scan_axis_the_tree_does_not_have(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_deepseek3")
    abstract = mx.abstract_params(maxtext_config("mt_deepseek3", True, 0), mesh)
    refused(path, abstract, maxtext_config("mt_deepseek3", True, 1), "param_scan_axis", "'deepseek3'",
            "decoder.dense_layers.")


def test_deepseek_unscanned_dense_layer_count(tiny_checkpoints, mesh, no_reads):
    path, _ = tiny_checkpoints("mt_deepseek2")
    abstract = mx.abstract_params(maxtext_config("mt_deepseek2", False, 1), mesh)
    refused(path, abstract, maxtext_config("mt_deepseek2", False, 1, first_num_dense_layers=2),
            "first_num_dense_layers", "decoder.dense_layers_{layer}", "'deepseek2'")


def test_gpt_oss_layer_cycle_other_than_the_tables(tiny_checkpoints, mesh):
    cfg = maxtext_config("mt_gpt_oss", True, 1)
    with pytest.raises(ConfigError) as info:
        mx.select({**cfg, "inhomogeneous_layer_cycle_interval": 4})
    assert info.value.field == "inhomogeneous_layer_cycle_interval" and "'gpt_oss'" in str(info.value)


def test_deepseek3_mtp_layers_beyond_one(tiny_checkpoints, mesh):
    with pytest.raises(ConfigError) as info:
        mx.select(maxtext_config("mt_deepseek3", True, 1, mtp_num_layers=2))
    assert info.value.field == "mtp_num_layers" and "'deepseek3'" in str(info.value)
