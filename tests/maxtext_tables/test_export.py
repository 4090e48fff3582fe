"""``otfload.maxtext.export``: MaxText parameters back to HF safetensors, bit-exact for every
table and layout (``sqrt(head_dim)`` a power of two here, so the query scale undoes exactly), with
the reference's ``config.json``; vocabulary padding cut off again."""

from __future__ import annotations

import json

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors
from tests.maxtext_tables.support import LAYOUTS, MODELS, maxtext_config


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tensor": 4})


def round_trip(path, cfg, mesh, out):
    params = mx.load_state(str(path), mx.abstract_params(cfg, mesh), cfg)[1]["params"]
    mx.export(params, out, cfg, reference=path)
    return hf_tensors(out)


@pytest.mark.parametrize("kind", sorted(MODELS))
@pytest.mark.parametrize(("scan", "axis"), LAYOUTS)
def test_round_trip_is_bit_exact(tiny_checkpoints, mesh, tmp_path, kind, scan, axis):
    path, _ = tiny_checkpoints(kind)
    written = round_trip(path, maxtext_config(kind, scan, axis), mesh, tmp_path / "out")
    original = hf_tensors(path)
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        assert written[key].dtype == value.dtype, key
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == json.loads((path / "config.json").read_text())


def test_padding_is_cut_off(tiny_checkpoints, mesh, tmp_path):
    path, _ = tiny_checkpoints("mt_llama")
    written = round_trip(path, maxtext_config("mt_llama", True, 1, vocab_size=320), mesh, tmp_path / "out")
    original = hf_tensors(path)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        np.testing.assert_array_equal(written[key], original[key])
