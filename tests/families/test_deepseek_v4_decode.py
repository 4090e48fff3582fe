"""DeepSeek-V4 decoding with the KV cache (the sliding keys, each compressor's windows and pending
tokens: :mod:`otfload.models.compressor`): each cached step's f32 logits equal transformers' full
forward (unscanned, on one device); greedy ids equal transformers' ``generate(do_sample=False)``
through ``otfload generate`` and the lm_eval backend's ``generate_until`` (against lm_eval's ``hf``
backend, one request at a time), both scanned with the experts on ``ep`` and the same [3, 23] batch:
one compiled decoding setup (:data:`otfload.generate._step`'s prefill and step programs), which the
second of them finds compiled.

The tiny model is tests/families/test_deepseek_v4.py's (sliding window 8, CSA windows of 4, HCA of
8). Prompts of 3, 5 and 23 tokens (below every window; past one CSA window; past the sliding window and
the HCA rate with a partial window pending) and 14 new tokens (each crosses at least one CSA and one
HCA window boundary and slides the window) in one left-padded batch: each row gets the ids
transformers gives it alone. Transformers' batched V4 pools its compressor windows from slot 0, pads
included, so its left-padded rows differ from the rows alone; otfload's cache cuts the windows from
each row's real tokens.
"""

import json

import jax
import numpy as np
import pytest

import otfload
import tests.families.test_deepseek_v4  # noqa: F401  (registers the tiny DeepSeek-V4)
from otfload.generate import cache_shardings
from otfload.plan.sharding import make_mesh
from tests.cli.test_eval import assert_generate_matches
from tests.eval_support import with_tokenizer
from tests.families.checks import MESHES
from tests.helpers import max_rel_diff, torch_logits
from tests.models.kinds import torch_greedy

NEW = 14
MESH = "fsdp=2,ep=4"  # both greedy tests' (otfload generate's --mesh; the lm_eval backend reads it too)


def greedy_alone(torch_model, ids: np.ndarray, mask: np.ndarray, new: int, **kw) -> np.ndarray:
    """transformers' greedy ``generate`` of each left-padded row of ``ids`` alone (its real tokens only),
    laid out as ``torch_greedy``'s batch: the padded prompt, then the row's ``new`` ids."""
    out = np.concatenate([ids, np.zeros((len(ids), new), ids.dtype)], axis=1)
    for r, row in enumerate(mask.astype(bool)):
        alone = ids[r : r + 1, row]
        out[r, ids.shape[1] :] = torch_greedy(torch_model, alone, np.ones_like(alone), new, **kw)[0, alone.shape[1] :]
    return out


# Texts the tiny tokenizer encodes to 3, 5 and 23 tokens (BOS included).
PROMPTS = ["a fox", "the quick brown fox",
           "a checkpoint is loaded on the fly into sharded arrays and the model predicts each token from the tokens"]


@pytest.fixture(scope="module")
def with_tokenizer_files(tiny_checkpoints, tmp_path_factory):
    """The tiny checkpoint with the tiny tokenizer (``tokenizer.json`` and its config) and the torch model.
    The tokenizer's config names the model's EOS token as its pad token: the pad otfload generate
    takes from ``config.json`` (its first EOS id, no pad id there) and the lm_eval backend from the
    tokenizer are then one, and so is the compiled decoding step that pads finished rows with it."""
    from tokenizers import Tokenizer

    from tests.lmeval.tasks import tokenizer_config

    path, torch_model = tiny_checkpoints("deepseek_v4")
    checkpoint = with_tokenizer(path, tmp_path_factory.mktemp("deepseek_v4_tok"))
    tokenizer_config(checkpoint)
    eos = json.loads((checkpoint / "config.json").read_text())["eos_token_id"]
    pad = Tokenizer.from_file(str(checkpoint / "tokenizer.json")).id_to_token(eos)
    config = checkpoint / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pad_token": pad}))
    return checkpoint, torch_model


def test_the_cache_holds_each_compressors_state_sharded_by_the_logical_axis_rules(tiny_checkpoints):
    path, _ = tiny_checkpoints("deepseek_v4")
    mesh = make_mesh(MESHES["fsdp2_ep4"])
    cache = otfload.from_pretrained(path, mesh=mesh).init_cache(2, 16)
    layers = cache["layers"]
    csa = layers["csa_moe_layers"]  # two layers of 16 slots: 4 windows of 4, 8 pending tokens of 2 series
    assert csa["k"].shape == (2, 2, 16, 1, 32) and csa["windows"].shape == (2, 2, 4, 32)
    assert csa["index_windows"].shape == (2, 2, 4, 16) and csa["pool_gate"].shape == (2, 2, 8, 64)
    hca = layers["hca_moe_layers"]  # one series, no indexer
    assert hca["pool_kv"].shape == (1, 2, 8, 32) and "index_windows" not in hca
    assert set(layers["sliding_hash_layers"]) == {"k"}
    assert bool((csa["pool_gate"][:, :, :4] == -np.inf).all())  # window 0's predecessor weighs nothing
    shardings = cache_shardings(cache, mesh)  # rows on fsdp, as every family's cache
    assert all(s.spec[1] == "fsdp" for s in jax.tree.leaves(shardings["layers"]))


def test_each_cached_steps_logits_equal_transformers_forward_of_the_whole_sequence(tiny_checkpoints):
    """An 11-token prefill then 29 one-token steps through the cache (every window kind completing
    several times, the sliding window sliding): each call's f32 logits equal transformers' full forward
    at those positions (unscanned, on one device: the greedy tests' mesh and scanned cache are theirs)."""
    path, torch_model = tiny_checkpoints("deepseek_v4")
    model = otfload.from_pretrained(path, scan_layers=False)
    ids = np.random.default_rng(1).integers(3, 256, (1, 40))
    ref = torch_logits(torch_model, ids)
    step = jax.jit(lambda m, x, cache: m(x, cache=cache))
    logits, cache = step(model, ids[:, :11], model.init_cache(1, 40))
    assert max_rel_diff(logits, ref[:, :11]) <= 1e-4
    for t in range(11, 40):
        logits, cache = step(model, ids[:, t : t + 1], cache)
        assert max_rel_diff(logits, ref[:, t : t + 1]) <= 1e-4, t


def test_otfload_generate_equals_transformers_of_each_prompt_alone(with_tokenizer_files, capsys):
    path, torch_model = with_tokenizer_files
    assert_generate_matches(path, torch_model, capsys, PROMPTS, NEW, greedy_alone, ("--mesh", MESH))


def test_lm_eval_generate_until_equals_the_hf_backend_one_request_at_a_time(with_tokenizer_files):
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from otfload.lm_eval import OtfloadLM

    path, _ = with_tokenizer_files
    requests = [Instance("generate_until", {}, (p, {"until": ["zebra"], "max_gen_toks": NEW}), i)
                for i, p in enumerate(PROMPTS)]
    # one batch of the three rows, as otfload generate's: its compiled programs
    ours = OtfloadLM(str(path), mesh=MESH, batch_size=3).generate_until(requests, disable_tqdm=True)
    ref = HFLM(pretrained=str(path), batch_size=1, device="cpu", dtype="float32").generate_until(requests,
                                                                                                disable_tqdm=True)
    assert ours == ref and len(set(ours)) == len(ours), (ours, ref)
