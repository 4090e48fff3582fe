"""Gemma against the real MaxText (maxtext 0.2.5, its venv) where MaxText's own loader is not the
reference: ``test_maxtext_drop_in.py`` has every Gemma leaf bitwise equal to MaxText's loader's and
MaxText's forward on the drop-in's tree; here are the two places MaxText's loader is wrong.

* Gemma 3's checkpoints keep their text model under ``language_model.model.`` (the Hub's releases and
  transformers' ``save_pretrained``); MaxText's converter reads ``model.language_model.`` (the names of
  transformers' modules in memory) and fails on the checkpoint as published. The drop-in reads either:
  on the published layout it gives every leaf bitwise what MaxText's loader gives on the renamed copy.
* Gemma 2 with ``query_pre_attn_scalar`` other than ``head_dim`` (gemma-2-9b: 224 and 256; -27b: 144 and
  128): MaxText's Gemma 2 attention applies no scale of its own, its converter pre-scales the query by
  ``1/sqrt(head_dim)``, the checkpoint means ``1/sqrt(query_pre_attn_scalar)``. The drop-in's query is
  MaxText's times ``sqrt(head_dim / query_pre_attn_scalar)``, its logits match transformers (the
  forward test there), MaxText's loader's do not.
* A bfloat16 checkpoint (Gemma's are published so) into MaxText's float32 weights: MaxText's loader
  casts only the leaves it stacks; the embedding, the final norm and every unstacked layer (Gemma 3's
  remainder) keep the checkpoint's bfloat16 in a float32 tree. The drop-in gives every leaf the tree's
  dtype, with MaxText's values (its ``+ 1`` and embedding scale rounded once to bfloat16, as MaxText's).
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from tests.helpers import max_rel_diff  # noqa: E402
from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import FAMILIES, HEAD_DIM  # noqa: E402
from tests.maxtext.test_maxtext_drop_in import FORWARD, bits, built, maxtext_loaded, otfload_loaded  # noqa: E402

GEMMA3, GEMMA3_LAYOUT = FAMILIES["gemma3"], (True, 1)
QPAS = FAMILIES["gemma2_qpas"]


def test_maxtext_loader_cannot_read_gemma3_as_published(refs):
    with pytest.raises(KeyError, match="model.language_model.embed_tokens.weight"):
        reference.maxtext_load(built(GEMMA3, GEMMA3_LAYOUT), refs / "gemma3_hub")


def test_drop_in_reads_gemma3_as_published(refs):
    """The published layout gives what MaxText's loader gives on transformers' module names."""
    from otfload.maxtext import load_state

    b = built(GEMMA3, GEMMA3_LAYOUT)
    ours = reference.flat(load_state(str(refs / "gemma3_hub"), b.params, b.config)[1]["params"])
    theirs = reference.flat(maxtext_loaded(GEMMA3, GEMMA3_LAYOUT, refs)["params"])
    assert set(ours) == set(theirs)
    for name, leaf in ours.items():
        np.testing.assert_array_equal(bits(leaf), bits(theirs[name]), err_msg=name)


def test_bf16_checkpoint_into_the_float32_tree(refs, tmp_path):
    import shutil

    import ml_dtypes
    from safetensors.numpy import load_file, save_file

    from otfload.maxtext import load_state

    path = tmp_path / "bf16"
    shutil.copytree(refs / GEMMA3.checkpoint, path)
    for shard in path.glob("*.safetensors"):
        tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})
    b = built(GEMMA3, GEMMA3_LAYOUT)
    want = reference.flat(b.params)
    ours = reference.flat(load_state(str(path), b.params, b.config)[1]["params"])
    theirs = reference.flat(reference.maxtext_load(b, path)["params"])
    kept = sorted(name for name, leaf in theirs.items() if leaf.dtype != want[name].dtype)
    assert "token_embedder.embedding" in kept and "decoder.decoder_norm.scale" in kept
    assert all(theirs[name].dtype == ml_dtypes.bfloat16 for name in kept)
    for name, target in want.items():
        assert ours[name].dtype == target.dtype == np.float32, name
        np.testing.assert_array_equal(np.asarray(ours[name]), np.asarray(theirs[name], np.float32), err_msg=name)


def test_gemma2_query_is_the_checkpoints_where_maxtexts_converter_is_not(refs):
    layout, tolerance = FORWARD[QPAS.name]
    ours = reference.flat(otfload_loaded(QPAS, layout, refs)["params"])
    theirs = maxtext_loaded(QPAS, layout, refs)
    flat = reference.flat(theirs["params"])
    scalar = QPAS.hf_extra["query_pre_attn_scalar"]
    queries = [name for name in ours if name.endswith(QPAS.maxtext_differs)]
    assert len(queries) == 2 * QPAS.maxtext_extra["base_num_decoder_layers"]
    for name in queries:
        mine, maxtexts = np.asarray(ours[name]), np.asarray(flat[name])
        assert not np.array_equal(mine, maxtexts), name
        np.testing.assert_allclose(mine, maxtexts * np.sqrt(HEAD_DIM / scalar), rtol=1e-6, err_msg=name)
    ids = np.load(refs / QPAS.checkpoint / "ids.npy")
    expected = np.load(refs / QPAS.checkpoint / "logits.npy")
    off = max_rel_diff(reference.logits(built(QPAS, layout), theirs, ids), expected)
    assert off > 4 * tolerance, off  # MaxText's own loader: another attention temperature than the checkpoint's
