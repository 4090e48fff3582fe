"""DeepSeek-V4 decoding with the KV cache (the sliding keys, each compressor's windows and pending
tokens: :mod:`otfload.models.compressor`): greedy ids equal transformers' ``generate(do_sample=False)``
through ``otfload.generate``, ``otfload generate`` (unscanned) and the lm_eval backend's
``generate_until`` (against lm_eval's ``hf`` backend, one request at a time).

The tiny model is tests/families/test_deepseek_v4.py's (sliding window 8, CSA windows of 4, HCA of
8). Prompts of 3, 12 and 21 tokens (below every window; past the sliding window and the HCA rate; past
both with a partial window pending) and 14 new tokens (each crosses at least one CSA and one HCA
window boundary and slides the window) in one left-padded batch: each row gets the ids transformers
gives it alone. Transformers' batched V4 pools its compressor windows from slot 0, pads included, so
its left-padded rows differ from the rows alone; otfload's cache cuts the windows from each row's
real tokens.
"""

import jax
import numpy as np
import pytest

import otfload
from otfload.generate import cache_shardings
from otfload.plan.sharding import make_mesh
from tests.cli.test_eval import assert_generate_matches
from tests.eval_support import with_tokenizer
from tests.families.checks import MESHES
from tests.families.test_deepseek_v4 import TINY
from tests.models.kinds import torch_greedy

NEW = 14
REAL = (3, 12, 21)


def greedy_alone(torch_model, ids: np.ndarray, mask: np.ndarray, new: int, **kw) -> np.ndarray:
    """transformers' greedy ``generate`` of each left-padded row of ``ids`` alone (its real tokens only),
    laid out as ``torch_greedy``'s batch: the padded prompt, then the row's ``new`` ids."""
    out = np.concatenate([ids, np.zeros((len(ids), new), ids.dtype)], axis=1)
    for r, row in enumerate(mask.astype(bool)):
        alone = ids[r : r + 1, row]
        out[r, ids.shape[1] :] = torch_greedy(torch_model, alone, np.ones_like(alone), new, **kw)[0, alone.shape[1] :]
    return out


def left_padded(real: tuple[int, ...], seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``real[r]`` random tokens each, left-padded with id 0 to the longest: ``(ids, mask)``."""
    rng, width = np.random.default_rng(seed), max(real)
    ids, mask = np.zeros((len(real), width), np.int64), np.zeros((len(real), width), np.int64)
    for r, n in enumerate(real):
        ids[r, width - n :], mask[r, width - n :] = rng.integers(3, TINY["vocab_size"], n), 1
    return ids, mask


# Texts the tiny tokenizer encodes to 5 and 23 tokens (BOS included).
PROMPTS = ["the quick brown fox",
           "a checkpoint is loaded on the fly into sharded arrays and the model predicts each token from the tokens"]


@pytest.fixture(scope="module")
def with_tokenizer_files(tiny_checkpoints, tmp_path_factory):
    """The tiny checkpoint with the tiny tokenizer (``tokenizer.json`` and its config) and the torch model."""
    from tests.lmeval.tasks import tokenizer_config

    path, torch_model = tiny_checkpoints("deepseek_v4")
    checkpoint = with_tokenizer(path, tmp_path_factory.mktemp("deepseek_v4_tok"))
    tokenizer_config(checkpoint)
    return checkpoint, torch_model


def test_greedy_ids_of_left_padded_rows_equal_transformers_of_each_row_alone(tiny_checkpoints):
    path, torch_model = tiny_checkpoints("deepseek_v4")
    mesh = make_mesh(MESHES["fsdp2_ep4"])
    model = otfload.from_pretrained(path, mesh=mesh)
    ids, mask = left_padded(REAL)
    with jax.set_mesh(mesh):
        ours = np.asarray(otfload.generate(model, ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=[]))
    np.testing.assert_array_equal(ours, greedy_alone(torch_model, ids, mask, NEW, eos_token_id=None))
    cache = model.init_cache(2, 16)
    csa = cache["layers"]["csa_moe_layers"]
    assert csa["windows"].shape == (2, 2, 4, 32) and csa["index_windows"].shape == (2, 2, 4, 16)
    assert csa["pool_gate"].shape == (2, 2, 8, 64) and "pool_kv" in cache["layers"]["hca_moe_layers"]
    assert "windows" not in cache["layers"]["sliding_hash_layers"]
    shardings = cache_shardings(cache, mesh)  # the logical-axis rules: rows on fsdp
    assert shardings["layers"]["csa_moe_layers"]["index_pool_kv"].spec[1] == "fsdp"


def test_otfload_generate_unscanned_equals_transformers_of_each_prompt_alone(with_tokenizer_files, capsys):
    path, torch_model = with_tokenizer_files
    assert_generate_matches(path, torch_model, capsys, PROMPTS, NEW, greedy_alone, ("--no-scan-layers",))


def test_lm_eval_generate_until_equals_the_hf_backend_one_request_at_a_time(with_tokenizer_files):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from otfload.lm_eval import OtfloadLM

    path, _ = with_tokenizer_files
    requests = [Instance("generate_until", {}, (p, {"until": ["zebra"], "max_gen_toks": NEW}), i)
                for i, p in enumerate(PROMPTS)]
    ours = OtfloadLM(str(path), mesh="fsdp:2/tp:4", batch_size=2).generate_until(requests, disable_tqdm=True)
    ref = HFLM(pretrained=str(path), batch_size=1, device="cpu", dtype="float32").generate_until(requests,
                                                                                                disable_tqdm=True)
    assert ours == ref and len(set(ours)) == len(ours), (ours, ref)
