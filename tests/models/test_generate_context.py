"""A generation that runs past ``max_position_embeddings`` says so (``ContextLengthWarning``, naming
the counts); one within it is silent."""

import json
import shutil
import warnings

import numpy as np
import pytest

import otfload
from otfload.generate import ContextLengthWarning

LIMIT = 10  # the copy's max_position_embeddings: an 8-token prompt leaves room for 2 new tokens


@pytest.fixture(scope="module")
def short_context_llama(tiny_checkpoints, tmp_path_factory):
    """The tiny llama whose config.json says it was trained on LIMIT positions."""
    path = shutil.copytree(tiny_checkpoints("llama")[0], tmp_path_factory.mktemp("short") / "llama")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": LIMIT}))
    return otfload.from_pretrained(path)


def test_past_max_position_embeddings_warns(short_context_llama):
    ids = np.arange(1, 9)[None]  # 8 prompt tokens
    with pytest.warns(ContextLengthWarning) as record:
        otfload.generate(short_context_llama, ids, max_new_tokens=3, eos_token_id=[])
    assert str(record[0].message).startswith(
        f"a prompt of 8 tokens and 3 new tokens take 11 positions, more than the model's max_position_embeddings "
        f"of {LIMIT} (config.json)")
    assert record[0].filename == __file__  # reported at the caller's line


def test_within_max_position_embeddings_is_silent(short_context_llama):
    ids = np.arange(1, 9)[None]
    mask = np.ones_like(ids)
    mask[0, :4] = 0  # left padding does not take positions: 4 real tokens + 6 new = 10
    with warnings.catch_warnings():
        warnings.simplefilter("error", ContextLengthWarning)
        otfload.generate(short_context_llama, ids, max_new_tokens=2, eos_token_id=[])
        otfload.generate(short_context_llama, ids, max_new_tokens=6, attention_mask=mask, eos_token_id=[])
