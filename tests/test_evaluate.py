"""``otfload.evaluate``: summed NLL, token counts and perplexity equal transformers' loss on the same
texts (per text, rel ≤ 1e-4 in float32), tokenized with the checkpoint's own ``tokenizer.json``
fetched from the same source (local, Hub, gs://); data files and malformed inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

import otfload
import tests.models.kinds  # noqa: F401  (registers the tiny model of every family)
from otfload.errors import EvalDataError, SourceNotFoundError, TokenizerError, TokenizerNotFoundError
from otfload.evaluate import read_texts
from otfload.tokenizer import load_tokenizer
from tests.eval_support import CORPUS, TEXTS, as_arrays, reference_nll, rel, with_tokenizer

MAX_LEN = 16  # cuts the two long texts of TEXTS


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tiny_checkpoints, tmp_path_factory):
    """``kind -> (directory with tokenizer.json, torch model)``, built once per kind."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path, torch_model = tiny_checkpoints(kind)
            built[kind] = with_tokenizer(path, tmp_path_factory.mktemp(f"{kind}-tok")), torch_model
        return built[kind]

    return get


def assert_matches(result, ref: list[tuple[float, int]]) -> None:
    nll, count = as_arrays(ref)
    np.testing.assert_array_equal(result.text_tokens, count)
    for i, (ours, theirs) in enumerate(zip(result.text_nll, nll, strict=True)):
        if count[i]:
            assert rel(ours, theirs) <= 1e-4, (i, ours, theirs)
        else:
            assert ours == 0.0
    assert result.tokens == int(count.sum())
    assert rel(result.nll, float(nll.sum())) <= 1e-4
    assert math.isclose(result.perplexity, math.exp(nll.sum() / count.sum()), rel_tol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "gemma2", "mixtral", "deepseek_v3"])
def test_matches_transformers_loss(checkpoint_with_tokenizer, mesh_2x4, kind):
    path, torch_model = checkpoint_with_tokenizer(kind)
    result = otfload.evaluate(path, TEXTS, max_len=MAX_LEN, batch_size=3, mesh=mesh_2x4, progress=False)
    assert_matches(result, reference_nll(torch_model, path / "tokenizer.json", TEXTS, MAX_LEN))
    assert (result.texts, result.skipped, result.max_len, result.batch_size) == (len(TEXTS), 2, MAX_LEN, 3)
    assert result.truncated == 2 and result.load_seconds > 0 and result.tokens_per_second > 0
    summary = result.to_dict()
    assert summary["nll"] == result.nll and summary["tokens"] == result.tokens
    assert summary["perplexity"] == result.perplexity and summary["scored"] == len(TEXTS) - 2


def test_model_batch_size_and_mesh_change_no_score(checkpoint_with_tokenizer):
    """A loaded model with its tokenizer scores as the checkpoint location does, one row per batch
    or all rows in one, on another mesh; the default max_len is the config's max_position_embeddings."""
    path, torch_model = checkpoint_with_tokenizer("llama")
    model = otfload.from_pretrained(path, mesh=otfload.make_mesh({"fsdp": 8}), progress=False)
    tokenizer = load_tokenizer(path)
    long = " ".join(CORPUS * 3)  # beyond the tiny config's 128 positions
    texts = [*TEXTS, long]
    assert len(tokenizer.encode(long).ids) > 128
    one = otfload.evaluate(model, texts, tokenizer=tokenizer, batch_size=1, progress=False)
    many = otfload.evaluate(model, texts, tokenizer=str(path), batch_size=16, progress=False)
    assert one.max_len == many.max_len == 128 and one.truncated == 1 and one.load_seconds == 0.0
    np.testing.assert_allclose(one.text_nll, many.text_nll, rtol=1e-5)
    assert_matches(many, reference_nll(torch_model, path / "tokenizer.json", texts, 128))


def test_only_empty_texts_predict_nothing(checkpoint_with_tokenizer):
    path, _ = checkpoint_with_tokenizer("llama")
    model = otfload.from_pretrained(path, progress=False)
    result = otfload.evaluate(model, ["", ""], tokenizer=load_tokenizer(path))
    assert (result.tokens, result.nll, result.skipped) == (0, 0.0, 2)
    assert math.isnan(result.perplexity)
    assert json.loads(json.dumps(result.to_dict()))["perplexity"] is None  # valid JSON: no NaN


def test_missing_tokenizer_is_a_typed_error_naming_it(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")  # no tokenizer.json
    with pytest.raises(TokenizerNotFoundError, match=r"tokenizer\.json not found in .*llama") as info:
        otfload.evaluate(path, ["some text"])
    assert isinstance(info.value, SourceNotFoundError)


def test_broken_tokenizer_json_is_a_typed_error(tiny_checkpoints, tmp_path):
    path, _ = tiny_checkpoints("llama")
    broken = with_tokenizer(path, tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json in .*broken: not a tokenizer"):
        load_tokenizer(broken)


def test_tokenizer_ids_beyond_the_embedding_are_refused(checkpoint_with_tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers

    path, _ = checkpoint_with_tokenizer("llama")
    model = otfload.from_pretrained(path, progress=False)
    other = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 300, "world": 5}, unk_token="<unk>"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(TokenizerError, match="id 300, but the model's embedding has 256 rows"):
        otfload.evaluate(model, ["hello world"], tokenizer=other)


def test_tokenizer_and_weights_from_the_hub_and_gcs(checkpoint_with_tokenizer, tiny_checkpoints, hub, gcs_server,
                                                    tmp_path):
    path, _ = checkpoint_with_tokenizer("llama")
    local = otfload.evaluate(path, TEXTS, max_len=MAX_LEN, progress=False)
    repo = hub.add_repo("org/eval-llama", path)
    remote = otfload.evaluate(repo, TEXTS, max_len=MAX_LEN, endpoint=hub.url, cache_dir=tmp_path / "hf",
                              progress=False)
    fetched = [r.path for r in hub.requests("GET", "/org/eval-llama/resolve/")]
    assert any(p.endswith("/tokenizer.json") for p in fetched), fetched  # from the repo itself
    np.testing.assert_allclose(remote.text_nll, local.text_nll, rtol=1e-6)
    url = gcs_server.upload_dir(path, "eval-bucket", "llama")
    bucket = otfload.evaluate(url, TEXTS, max_len=MAX_LEN, storage_options=gcs_server.storage_options,
                              progress=False)
    np.testing.assert_allclose(bucket.text_nll, local.text_nll, rtol=1e-6)
    bare = hub.add_repo("org/no-tokenizer", tiny_checkpoints("llama")[0])
    with pytest.raises(TokenizerNotFoundError, match="hub:org/no-tokenizer"):
        load_tokenizer(bare, endpoint=hub.url, cache_dir=tmp_path / "hf")


# --- data files ----------------------------------------------------------------------------------


def test_jsonl_records_and_text_lines(tmp_path: Path):
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text('{"text": "first", "id": 1}\n\n{"text": ""}\r\n{"text": "line\\nbreak"}\n')
    assert read_texts(jsonl) == ["first", "", "line\nbreak"]  # blank lines are no records
    other = tmp_path / "other.ndjson"
    other.write_text('{"body": "x"}\n')
    assert read_texts(other, key="body") == ["x"]
    text = tmp_path / "data.txt"
    text.write_text("first line\n\nthird \r\nlast")
    assert read_texts(text) == ["first line", "", "third ", "last"]  # a blank line is an empty text
    assert read_texts(jsonl, fmt="text")[0] == '{"text": "first", "id": 1}'


@pytest.mark.parametrize(("body", "message"), [
    ('{"text": "ok"}\n{"text": \n', r"data\.jsonl:2: not a JSON object"),
    ('["a list"]\n', r"data\.jsonl:1: expected a JSON object with a 'text' field, got list"),
    ('{"text": "ok"}\n{"content": "x"}\n', r"data\.jsonl:2: field 'text' must be a string \(no such field\)"),
    ('{"text": 5}\n', r"data\.jsonl:1: field 'text' must be a string \(int\)"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path: Path, body: str, message: str):
    path = tmp_path / "data.jsonl"
    path.write_text(body)
    with pytest.raises(EvalDataError, match=message):
        read_texts(path)


def test_non_utf8_data_is_a_typed_error(tmp_path: Path):
    path = tmp_path / "data.txt"
    path.write_bytes(b"caf\xe9\n")
    with pytest.raises(EvalDataError, match=r"data\.txt: not UTF-8"):
        read_texts(path)
