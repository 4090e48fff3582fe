"""The registry finds the family packages under ``otfload.families`` without a list (a new package
that calls ``register`` is supported once it exists), and adapters get a family's LoRA layout
through it."""

import sys

import otfload.families
from otfload.adapters.merge import lora_layout
from otfload.families import registry
from otfload.families.lora import QWEN2_MOE, ExpertLayout
from otfload.families.mixtral.mapping import MIXTRAL_LORA

# A family package as a newcomer would add one: Llama's model and table under a new model_type.
NEW_FAMILY = """
import dataclasses

from otfload.families.llama import LLAMA
from otfload.families.registry import register

TINY = register(dataclasses.replace(LLAMA, name="tiny", model_types=("tiny_family",)))
"""


def test_a_new_family_package_is_found_without_a_list(tmp_path, monkeypatch):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "__init__.py").write_text(NEW_FAMILY)
    registry.supported_model_types()  # the built-in packages register (once per process) before the copy
    monkeypatch.setattr(otfload.families, "__path__", [*otfload.families.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_FAMILIES", dict(registry._FAMILIES))
    registry._load_builtin_families.cache_clear()
    try:
        assert registry.family_for({"model_type": "tiny_family"}).name == "tiny"
        assert {"tiny_family", "llama", "mixtral"} <= set(registry.supported_model_types())
    finally:
        registry._load_builtin_families.cache_clear()
        sys.modules.pop("otfload.families.tiny", None)


def test_lora_layouts_come_from_the_families():
    assert lora_layout("mixtral") == MIXTRAL_LORA
    assert lora_layout("qwen3_moe") == lora_layout("deepseek_v2") == lora_layout("deepseek_v3") == QWEN2_MOE
    assert lora_layout("gpt_oss") == ExpertLayout(transposed=True)
    # No renames or fused experts: dense families, Kimi-K2 (no transformers model type) and the text
    # models of multimodal checkpoints, and a model type no family registers.
    for model_type in ("llama", "gemma3", "kimi_k2", "kimi_k25", "not_a_family", None):
        assert lora_layout(model_type) == ExpertLayout()
