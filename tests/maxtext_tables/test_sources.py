"""``load_state``'s ``path`` as MaxText's ``load_parameters_path`` names it: a remote URL read by
ranges through otfload's sources (here fsspec's in-memory store, as ``gs://`` and ``s3://`` are),
and a Hub id spelt ``hf://`` (MaxText's spelling) reaching otfload's Hub source."""

from __future__ import annotations

import numpy as np
import pytest

import otfload.maxtext as mx
from otfload.errors import SourceError
from otfload.plan.sharding import make_mesh
from tests.helpers import hf_tensors, memory_copy
from tests.maxtext_tables.support import expected, maxtext_config


def test_remote_url_loads_the_same_leaves(tiny_checkpoints):
    path, _ = tiny_checkpoints("mt_mixtral")
    cfg = maxtext_config("mt_mixtral", True, 1)
    abstract = mx.abstract_params(cfg, make_mesh({"fsdp": 2, "tensor": 4}))
    params = mx.load_state(memory_copy(path), abstract, cfg)[1]["params"]
    want = expected("mt_mixtral", hf_tensors(path), cfg)
    got = np.asarray(params["decoder"]["layers"]["MoeBlock_0"]["wi_0"])
    np.testing.assert_array_equal(got, want["decoder.layers.MoeBlock_0.wi_0"])


def test_hf_scheme_is_a_hub_id(tiny_checkpoints):
    cfg = maxtext_config("mt_llama", True, 1)
    abstract = mx.abstract_params(cfg)
    with pytest.raises(SourceError) as info:  # no network: the Hub source is asked for the id, and fails
        mx.load_state("hf://no-such-org/no-such-model", abstract, cfg, local_files_only=True)
    assert "no-such-org/no-such-model" in str(info.value) and "hf://" not in str(info.value)
