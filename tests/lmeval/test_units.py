"""The pieces of the lm_eval backend on their own: widths chosen from the data (against a brute
force over every set of widths), the tokenizer config's special tokens and decoding (against
transformers' fast tokenizer on the same files), and requests refused with typed errors."""

from __future__ import annotations

import itertools
import json
import random

import jax
import pytest

from otfload.errors import EvalRequestError, TokenizerError
from otfload.lm_eval.buckets import choose_widths, width_for
from otfload.sources.owned import owned_source
from tests.eval_support import CORPUS, SPECIAL, VOCAB_SIZE, build_tokenizer


def brute_force(lengths, max_width, max_shapes, align):
    candidates = sorted({min(-(-n // align) * align, max_width) for n in lengths})
    best = None
    for k in range(1, max_shapes + 1):
        for widths in itertools.combinations(candidates, k):
            if widths[-1] < max(lengths):
                continue
            cost = sum(width_for(n, widths) for n in lengths)
            best = cost if best is None else min(best, cost)
    return best


@pytest.mark.parametrize("seed", range(6))
def test_widths_pad_least_with_at_most_max_shapes(seed):
    rng = random.Random(seed)
    max_width = rng.choice([64, 100, 128])
    lengths = [rng.randint(1, max_width) for _ in range(rng.randint(1, 30))]
    max_shapes = rng.randint(1, 4)
    widths = choose_widths(lengths, max_width, max_shapes=max_shapes, align=8)
    assert len(widths) <= max_shapes and widths == sorted(widths)
    assert all(w % 8 == 0 or w == max_width for w in widths)
    assert sum(width_for(n, widths) for n in lengths) == brute_force(lengths, max_width, max_shapes, 8)


def test_widths_edge_cases():
    assert choose_widths([], 128) == []
    assert choose_widths([5, 5, 5], 128) == [16]
    assert choose_widths([120, 3], 128, max_shapes=1) == [128]  # capped at max_width
    with pytest.raises(ValueError, match="no width holds 40"):
        width_for(40, [16, 32])


PUNCTUATED = "the lazy dog , it's over . isn't it ? we've seen it !"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """The tiny tokenizer, its vocabulary trained with punctuation too (decoding's clean-up acts on it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tok")
    build_tokenizer(root / "tokenizer.json")
    tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    fresh = Tokenizer(models.BPE(unk_token="<unk>"))
    fresh.pre_tokenizer, fresh.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    fresh.post_processor = tokenizer.post_processor
    fresh.train_from_iterator([*CORPUS, PUNCTUATED], trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False))
    fresh.save(str(root / "tokenizer.json"))
    return root


def checkpoint_tokenizer_of(root, tokenizer_config, model_config=None):
    from otfload.lm_eval.tokens import checkpoint_tokenizer

    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    with owned_source(root) as source:
        return checkpoint_tokenizer(source, model_config or {})


@pytest.mark.parametrize("forced", [False, True])
def test_special_tokens_and_decoding_match_transformers(tokenizer_dir, forced):
    from transformers import AutoTokenizer

    from otfload.lm_eval.tokens import FORCE_BPE_CLEAN_UP

    bos = {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False}  # as transformers 4 wrote it
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "</s>",
              "unk_token": "<unk>", "clean_up_tokenization_spaces": True, FORCE_BPE_CLEAN_UP: forced}
    ours = checkpoint_tokenizer_of(tokenizer_dir, config)
    theirs = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert (ours.bos_id, ours.eos_id, ours.unk_id) == (theirs.bos_token_id, theirs.eos_token_id, theirs.unk_token_id)
    assert ours.pad_id == theirs.unk_token_id  # lm_eval pads with UNK when the tokenizer names no padding
    cleaned = "the lazy dog, it's over. isn't it? we've seen it!"
    assert (ours.decode(ours.encode(PUNCTUATED)) == cleaned) == forced  # a BPE model is cleaned up only if forced
    for special in (True, False):
        ids = ours.encode(PUNCTUATED, add_special_tokens=special)
        assert ids == theirs.encode(PUNCTUATED, add_special_tokens=special)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True)
        assert ours.decode(ids, False) == theirs.decode(ids, skip_special_tokens=False)


def test_special_tokens_fall_back_to_config_json_ids(tokenizer_dir):
    ours = checkpoint_tokenizer_of(tokenizer_dir, {}, {"bos_token_id": 1, "eos_token_id": [2, 0]})
    assert (ours.bos_id, ours.eos_id, ours.unk_id, ours.pad_id) == (1, 2, None, 2)


def test_a_special_token_outside_the_vocabulary_is_a_typed_error(tokenizer_dir):
    with pytest.raises(TokenizerError, match="eos_token '<eot>' is not in tokenizer.json"):
        checkpoint_tokenizer_of(tokenizer_dir, {"eos_token": "<eot>"})


def test_requests_the_backend_cannot_honour():
    from otfload.lm_eval.generation import generation_options
    from otfload.lm_eval.scoring import make_groups

    with pytest.raises(EvalRequestError, match="sampling"):
        generation_options({"do_sample": True, "temperature": 0.7}, 32, "</s>")
    with pytest.raises(EvalRequestError, match="sampling"):
        generation_options({"temperature": 0.5}, 32, "</s>")
    with pytest.raises(EvalRequestError, match="does not fit the context window"):
        make_groups([([1, 2], list(range(9)))], max_length=8)
    with pytest.raises(EvalRequestError, match="empty continuation"):
        make_groups([([1, 2], [])], max_length=8)
    options = generation_options({"until": "\n\n", "max_new_tokens": 7, "do_sample": False}, 32, "</s>")
    assert (options.until, options.max_gen_toks) == (("\n\n", "</s>"), 7)
    (row,) = make_groups([(list(range(10, 20)), [20, 21])], max_length=8)  # cut on the left to 8 ids, as lm_eval does
    assert row.ids.tolist() == list(range(13, 21)) and row.positions.tolist() == list(range(8))
    assert row.at.tolist() == [6, 7] and row.targets.tolist() == [20, 21] and row.counts == (2,)


def test_continuations_of_one_context_are_packed_after_it():
    """Each continuation of a shared context is a branch after it: its positions continue from the
    context's end, its first id is predicted by the context's last slot; a pack wider than
    ``pack_width`` starts a new group, and a request cut to ``max_length`` is alone in its group."""
    from otfload.lm_eval.scoring import make_groups

    context = [1, 2, 3]
    requests = [(context, [4, 5]), (context, [6]), ([9], [7, 8]), (context, [5, 5, 5]), ([8] * 6, [4, 4, 4])]
    groups = {g.requests: g for g in make_groups(requests, max_length=6, pack_width=5)}
    assert set(groups) == {(0, 1), (2,), (3,), (4,)}
    packed = groups[(0, 1)]
    assert packed.ids.tolist() == [1, 2, 3, 4] and packed.positions.tolist() == [0, 1, 2, 3]
    assert packed.branches.tolist() == [0, 0, 0, 1] and packed.counts == (2, 1)
    assert packed.at.tolist() == [2, 3, 2] and packed.targets.tolist() == [4, 5, 6]
    alone = groups[(3,)]
    assert alone.ids.tolist() == [1, 2, 3, 5, 5] and alone.positions.tolist() == [0, 1, 2, 3, 4]
    assert alone.at.tolist() == [2, 3, 4] and alone.targets.tolist() == [5, 5, 5]
    cut = groups[(4,)]  # 6 + 3 ids > max_length + 1: (context + continuation)[-7:][:-1]
    assert cut.ids.tolist() == [8, 8, 8, 8, 4, 4] and cut.at.tolist() == [3, 4, 5] and cut.targets.tolist() == [4] * 3
    wide = {r.requests: r for r in make_groups(requests, max_length=6)}  # pack_width: max_length
    three = wide[(0, 1, 3)]
    assert three.ids.tolist() == [1, 2, 3, 4, 5, 5] and three.positions.tolist() == [0, 1, 2, 3, 3, 4]
    assert three.branches.tolist() == [0, 0, 0, 1, 3, 3] and three.at.tolist() == [2, 3, 2, 2, 4, 5]


def test_groups_are_packed_into_rows_of_one_width():
    """Groups go longest first into the row with the most room (one width: the longest group's,
    rounded up to 16), so a job has one shape; the scored count is the most any batch scores."""
    from otfload.lm_eval.scoring import Scorer, Timings, make_groups

    lengths = [20, 3, 9, 12, 5, 7, 16, 2, 4, 11]
    requests = [([1] * (n - 1), [2, 3]) for n in lengths]  # distinct contexts: one group each, n slots
    groups = make_groups(requests, max_length=64)
    assert sorted(len(g.ids) for g in groups) == sorted(lengths)
    batches = Scorer(2, 64, None, None, Timings()).plan(groups)
    assert {shape for _, shape in batches} == {batches[0][1]} and batches[0][1].width == 32
    rows = [row for batch, _ in batches for row in batch]
    assert sorted(i for row in rows for i in row) == list(range(len(groups)))
    assert all(sum(len(groups[i].ids) for i in row) <= 32 for row in rows) and len(rows) == 3  # 89 slots
    most = max(sum(len(groups[i].at) for row in batch for i in row) for batch, _ in batches)
    assert batches[0][1].scored == -(-most // 16) * 16
    assert batches[0][1].rows == 2


def test_rows_are_dealt_evenly_to_the_fewest_batches():
    """Five rows at ``batch_size`` 4 are two batches of at most 3 rows (not 4 and 1 padded to 4: a
    filler row costs a full row's work); on a mesh whose batch axes split rows two ways, a batch
    holds a multiple of 2 (here 4), so rows stay sharded."""
    import otfload
    from otfload.lm_eval.scoring import Scorer, Timings, make_groups

    requests = [([k + 1] * 19, [2, 3]) for k in range(5)]  # distinct contexts, 20 slots each: a row each
    groups = make_groups(requests, max_length=64)
    batches = Scorer(4, 64, None, None, Timings()).plan(groups)
    assert [len(batch) for batch, _ in batches] == [3, 2] and batches[0][1].rows == 3
    mesh = otfload.make_mesh({"fsdp": 2}, devices=jax.devices()[:2])
    on_mesh = Scorer(4, 64, mesh, None, Timings())
    shape = on_mesh.plan(groups)[0][1]
    assert shape.rows == 4
    ids = on_mesh._arguments(shape)[0]
    assert ids.shape == (4, 32) and ids.sharding.shard_shape(ids.shape) == (2, 32)
