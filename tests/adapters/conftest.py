"""Adapters built once per session: ``peft_adapters(name) -> (base dir, torch model, [adapter dirs])``."""

from __future__ import annotations

import pytest

import tests.families.test_gpt_oss  # noqa: F401  (registers the MoE kinds)
import tests.families.test_mixtral  # noqa: F401
import tests.families.test_qwen3_moe  # noqa: F401
from tests.adapters.support import ADAPTERS, PER_EXPERT, make_adapter, per_expert_adapter


@pytest.fixture(scope="session")
def peft_adapters(tiny_checkpoints, tmp_path_factory):
    """Named adapter sets (``ADAPTERS``, or ``<kind>_per_expert``) on their tiny base checkpoints."""
    made: dict = {}
    root = tmp_path_factory.mktemp("adapters")

    def get(name: str):
        if name not in made:
            if name.endswith("_per_expert"):
                kind = name.removesuffix("_per_expert")
                path, torch_model = tiny_checkpoints(kind)
                dirs = [per_expert_adapter(path, root / name, PER_EXPERT[kind])]
            else:
                kind, configs, dtype = ADAPTERS[name]
                path, torch_model = tiny_checkpoints(kind)
                dirs = [make_adapter(torch_model, root / f"{name}-{i}", seed=i, dtype=dtype, **config)
                        for i, config in enumerate(configs)]
            made[name] = (path, torch_model, dirs)
        return made[name]

    return get
