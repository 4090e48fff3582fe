"""Score text with a checkpoint: summed negative log-likelihood, token count and perplexity.

    result = otfload.evaluate("meta-llama/Llama-3.2-1B", ["first text", "second text"], max_len=2048)
    print(result.perplexity, result.tokens_per_second)

A thin layer above the API: :func:`~otfload.api.from_pretrained` loads the model, the checkpoint's
own ``tokenizer.json`` (fetched from the same source, :mod:`otfload.tokenizer`) turns each text into
ids with the special tokens its post-processor adds, and the model's padded forward pass scores
them. Each text is scored on its own: its first ``max_len`` ids are kept and each id after the
first is predicted from the ones before it, so a text of ``n`` ids contributes ``n - 1`` predicted
tokens (empty and one-token texts contribute none and are counted as ``skipped``). This is what
transformers' ``model(ids, labels=ids).loss`` averages, times the count.

Batching: texts are sorted by length and cut into batches of ``batch_size`` rows, each padded on
the right to a bucket width (a power of two, at most ``max_len``) so few shapes are compiled; the
padding is masked (``attention_mask``), which changes no real token's logits. Rows fill the batch's
data-parallel mesh axes; the last batch is filled up with one-token rows that predict nothing. The
log-softmax is computed in float32 whatever the parameter dtype; each row's NLL is summed on the
device in float32 and the rows are added in float64 on the host. Each batch width is compiled
ahead of its first run, so compilation time is reported apart from the tokens/s of scoring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from otfload.errors import EvalDataError, InvalidOptionError, TokenizerError
from otfload.models.base import CausalLM
from otfload.options import LoadKeywords, LoadOptions, resolve_options
from otfload.programs import CachedJit
from otfload.sources.base import Source

if TYPE_CHECKING:  # tokenizers is imported when first used
    from tokenizers import Tokenizer

    from otfload.tokenizer import TokenizerSpec

DEFAULT_BATCH_SIZE = 8  # rows per forward pass; a multiple of the usual data-parallel mesh sizes
# Narrowest bucket: shorter batches are padded to this many slots (a shape of its own per power of
# two below it would cost a compilation each and save next to nothing).
MIN_BUCKET = 16
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class EvalResult:
    """What :func:`evaluate` measured. ``nll`` is summed over ``tokens`` predicted tokens (nats);
    ``text_nll``/``text_tokens`` hold each text's share, in the order the texts were given."""

    nll: float
    tokens: int
    texts: int
    skipped: int  # empty and one-token texts: nothing to predict
    truncated: int  # texts longer than max_len ids, cut to their first max_len
    max_len: int | None
    batch_size: int
    load_seconds: float  # tokenizer and weights (0 for a model passed in)
    eval_seconds: float  # tokenizing and scoring, compilation included
    compile_seconds: float = 0.0  # of eval_seconds, compiling the scoring step (once per batch width)
    lower_seconds: float = 0.0  # of compile_seconds, tracing and lowering (0 for programs kept by an earlier job)
    text_nll: tuple[float, ...] = field(default=(), repr=False)
    text_tokens: tuple[int, ...] = field(default=(), repr=False)

    @property
    def perplexity(self) -> float:
        """``exp(nll / tokens)``; NaN when no token was predicted."""
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan

    @property
    def tokens_per_second(self) -> float:
        """Predicted tokens per second of scoring: ``eval_seconds`` less ``compile_seconds``."""
        seconds = self.eval_seconds - self.compile_seconds
        return self.tokens / seconds if seconds > 0 else math.nan

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``otfload eval --json`` prints (NaN as null); per-text values left out."""
        out = {
            "nll": self.nll, "tokens": self.tokens, "perplexity": self.perplexity,
            "nll_per_token": self.nll / self.tokens if self.tokens else math.nan,
            "texts": self.texts, "scored": self.texts - self.skipped, "skipped": self.skipped,
            "truncated": self.truncated, "max_len": self.max_len, "batch_size": self.batch_size,
            "load_seconds": self.load_seconds, "eval_seconds": self.eval_seconds,
            "compile_seconds": self.compile_seconds, "lower_seconds": self.lower_seconds,
            "tokens_per_second": self.tokens_per_second,
        }
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in out.items()}

    def summary(self) -> str:
        """The human-readable lines ``otfload eval`` prints."""
        cut = f"; {self.truncated} truncated to {self.max_len} tokens" if self.truncated else ""
        lines = [f"texts: {self.texts} ({self.skipped} empty or one-token, skipped{cut})"]
        if self.tokens:
            lines.append(f"nll: {self.nll:.6f} nats over {self.tokens} predicted tokens "
                         f"({self.nll / self.tokens:.6f} per token), perplexity {self.perplexity:.6g}")
        else:
            lines.append("nll: no token predicted (every text is empty or one token long)")
        lines.append(f"load: {self.load_seconds:.2f} s; eval: {self.eval_seconds:.2f} s (compiling "
                     f"{self.compile_seconds:.2f} s); {self.tokens_per_second:.1f} tokens/s")
        return "\n".join(lines)


def read_texts(path: str | os.PathLike[str], fmt: str = "auto", key: str = "text") -> list[str]:
    """The texts of a data file (a local path or an fsspec URL).

    ``fmt="jsonl"``: one JSON object per line, the text under ``key`` (blank lines are ignored);
    ``fmt="text"``: every line is one text, without its line break (a blank line is an empty
    text). ``"auto"`` reads ``.jsonl``/``.ndjson`` files as JSONL and anything else as text. A file
    that is missing, a directory, unreadable or not what its format says raises ``EvalDataError``.
    """
    name = os.fspath(path)
    if fmt == "auto":
        fmt = "jsonl" if name.lower().endswith(JSONL_SUFFIXES) else "text"
    if fmt not in ("jsonl", "text"):
        raise InvalidOptionError(f"unknown data format {fmt!r}; expected 'auto', 'jsonl' or 'text'")
    try:
        lines = _read_lines(name)
    except UnicodeDecodeError as e:
        raise EvalDataError(f"{name}: not UTF-8 text ({e})") from None
    except FileNotFoundError:
        raise EvalDataError(f"data file {name!r} does not exist") from None
    except IsADirectoryError:
        raise EvalDataError(f"data file {name!r} is a directory; expected a .jsonl or text file") from None
    except OSError as e:
        raise EvalDataError(f"data file {name!r} cannot be read: {e.strerror or e}") from None
    if fmt == "text":
        return [line.rstrip("\r\n") for line in lines]
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise EvalDataError(f"{name}:{number}: not a JSON object ({e})") from None
        if not isinstance(record, dict):
            raise EvalDataError(f"{name}:{number}: expected a JSON object with a {key!r} field, "
                                f"got {type(record).__name__}")
        if not isinstance(record.get(key), str):
            got = "no such field" if key not in record else type(record[key]).__name__
            raise EvalDataError(f"{name}:{number}: field {key!r} must be a string ({got})")
        texts.append(record[key])
    return texts


def _read_lines(name: str) -> list[str]:
    if "://" in name:
        import fsspec

        with fsspec.open(name, "rt", encoding="utf-8", newline="") as f:
            text: str = f.read()
            return text.splitlines(keepends=True)
    with open(Path(name).expanduser(), encoding="utf-8", newline="") as f:
        return list(f)


def encode(tokenizer: Tokenizer, texts: Sequence[str], max_len: int | None) -> tuple[list[np.ndarray], int]:
    """Each text's ids (special tokens as the tokenizer's post-processor adds them), cut to their
    first ``max_len``; and how many texts were cut."""
    ids = [np.asarray(e.ids, np.int32) for e in tokenizer.encode_batch(list(texts))]
    truncated = sum(max_len is not None and len(x) > max_len for x in ids)
    return ([x[:max_len] for x in ids] if max_len is not None else ids), truncated


def bucket(length: int, max_len: int | None) -> int:
    """The padded width of a batch whose longest row has ``length`` ids."""
    width = max(MIN_BUCKET, 1 << (length - 1).bit_length())
    return min(width, max_len) if max_len is not None else width


def _nll_of_batch(model: CausalLM, ids: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: summed NLL of each real id predicted from the real ids before it, and their count."""
    out = model(ids, attention_mask=mask)
    assert not isinstance(out, tuple)  # without a cache the model returns the logits alone
    logits = out[:, :-1].astype(jnp.float32)
    target = ids[:, 1:]
    picked = jnp.take_along_axis(logits, target[..., None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(logits, axis=-1) - picked
    valid = mask[:, 1:] & mask[:, :-1]
    return jnp.where(valid, nll, 0.0).sum(-1), valid.sum(-1)


_score = CachedJit(_nll_of_batch)


def score(
    model: CausalLM, sequences: Sequence[np.ndarray], *, batch_size: int = DEFAULT_BATCH_SIZE,
    max_len: int | None = None, progress: bool | None = None,
) -> tuple[np.ndarray, np.ndarray, float, float]:
    """Summed NLL (float64) and predicted-token count of each id sequence, scored independently,
    the seconds spent compiling (once per batch width, ahead of running it) and, of those, tracing
    and lowering (none for a program kept by an earlier job: :mod:`otfload.programs`).

    ``sequences`` are 1-d int arrays no longer than ``max_len``; sequences of fewer than 2 ids
    predict nothing (0, 0). ``progress`` shows a bar of predicted tokens on stderr (None: when
    stderr is a terminal).
    """
    from tqdm.auto import tqdm

    from otfload.generate import model_mesh

    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1; got {batch_size}")
    nll = np.zeros(len(sequences), np.float64)
    count = np.zeros(len(sequences), np.int64)
    order = sorted((i for i, s in enumerate(sequences) if len(s) >= 2), key=lambda i: -len(sequences[i]))
    if not order:
        return nll, count, 0.0, 0.0
    _check_vocab(model, sequences)
    mesh = model_mesh(model)
    show = sys.stderr.isatty() if progress is None else progress
    bar = tqdm(total=sum(len(sequences[i]) - 1 for i in order), unit="tok", desc="eval", disable=not show,
               file=sys.stderr, dynamic_ncols=True)
    pending: list[tuple[list[int], Any]] = []
    compiled: dict[tuple[int, ...], Any] = {}
    compile_seconds = lower_seconds = 0.0

    def collect() -> None:
        rows, out = pending.pop(0)
        sums, counts = (np.asarray(a) for a in out)
        nll[rows] = sums[: len(rows)].astype(np.float64)
        count[rows] = counts[: len(rows)]
        bar.update(int(counts[: len(rows)].sum()))

    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext(), bar:
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            ids, mask = _pack([sequences[i] for i in rows], batch_size, bucket(len(sequences[rows[0]]), max_len))
            if mesh is not None:
                ids, mask = (jax.device_put(a, _batch_sharding(a.shape, mesh)) for a in (ids, mask))
            if ids.shape not in compiled:  # compiled ahead, so that its time is known apart
                program = _score.compile(model, ids, mask)
                compiled[ids.shape] = program.compiled
                compile_seconds += program.seconds
                lower_seconds += program.lower_seconds
            pending.append((rows, compiled[ids.shape](model, ids, mask)))  # dispatched; collected a batch later
            if len(pending) > 1:
                collect()
        while pending:
            collect()
    return nll, count, compile_seconds, lower_seconds


def _pack(rows: list[np.ndarray], batch_size: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask) [batch_size, width]``: the rows padded on the right; missing rows are one
    masked-in token (they predict nothing, and no row is all padding)."""
    ids = np.zeros((batch_size, width), np.int32)
    mask = np.zeros((batch_size, width), bool)
    for r, seq in enumerate(rows):
        ids[r, : len(seq)], mask[r, : len(seq)] = seq, True
    mask[len(rows):, 0] = True
    return ids, mask


def _batch_sharding(shape: tuple[int, ...], mesh: Mesh) -> NamedSharding:
    from otfload.plan.sharding import logical_to_sharding

    return logical_to_sharding(("batch", None), shape, mesh)


def _check_vocab(model: CausalLM, sequences: Sequence[np.ndarray]) -> None:
    """A tokenizer id beyond the embedding would be clamped silently by the lookup: refuse it."""
    embedding = getattr(getattr(model, "embed", None), "embedding", None)
    if embedding is None:
        return
    rows = int(embedding.get_value().shape[0])
    top = max((int(s.max()) for s in sequences if len(s)), default=-1)
    if top >= rows:
        raise TokenizerError(f"the tokenizer gives id {top}, but the model's embedding has {rows} rows "
                             "(a tokenizer of another model?)")


def model_config(model: CausalLM) -> dict[str, Any]:
    """The ``config.json`` a bundled model was built from (its ``text_config`` for multimodal
    checkpoints); empty for a model otfload did not build."""
    from otfload.generate import config_with

    return config_with(model, "max_position_embeddings")


def load_with_tokenizer(
    location: str | os.PathLike[str] | Source, tokenizer: TokenizerSpec | None = None, *,
    options: LoadOptions | None = None, **keywords: Unpack[LoadKeywords],
) -> tuple[CausalLM, Tokenizer, float]:
    """``(model, tokenizer, seconds)``: the checkpoint at ``location`` loaded with
    :func:`~otfload.api.from_pretrained` (``options`` and ``keywords`` are its own) and its
    ``tokenizer.json`` read from the same source, before any weight (a missing tokenizer fails
    fast). ``tokenizer`` (a ``tokenizers.Tokenizer`` or another location) overrides it."""
    from otfload.api import from_pretrained
    from otfload.sources.owned import owned_source
    from otfload.tokenizer import as_tokenizer, tokenizer_from_source

    load_options = resolve_options(options, keywords)  # return_report, say, is no option: the time is returned
    source_options = load_options.source_options()
    start = time.perf_counter()
    with owned_source(location, **source_options) as source:
        tok = tokenizer_from_source(source) if tokenizer is None else as_tokenizer(tokenizer, **source_options)
        model = from_pretrained(source, options=load_options)
    assert isinstance(model, CausalLM)  # from_pretrained builds a bundled family model
    return model, tok, time.perf_counter() - start


def evaluate(
    source_or_model: CausalLM | str | os.PathLike[str] | Source,
    texts: Iterable[str],
    *,
    tokenizer: TokenizerSpec | None = None,
    max_len: int | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool | None = None,
    options: LoadOptions | None = None,
    **keywords: Any,  # LoadKeywords but progress, which is this function's own (the load's too, unless set)
) -> EvalResult:
    """Score ``texts`` with a checkpoint (any location :func:`~otfload.api.from_pretrained` takes,
    loaded with ``options`` and ``keywords``: ``mesh``, ``dtype``, ``revision``, ...; the load's
    progress bar is ``progress`` unless they set it) or with a bundled model.

    Each text is tokenized with the checkpoint's ``tokenizer.json`` (``tokenizer`` overrides it: a
    ``tokenizers.Tokenizer`` or a location; required with a model, which does not know its
    source), cut to its first ``max_len`` ids (default: the config's ``max_position_embeddings``;
    without one, no limit) and scored on its own.
    Returns an :class:`EvalResult` (``nll`` in nats, ``tokens``, ``perplexity``, timings).
    """
    from flax import nnx

    from otfload.tokenizer import as_tokenizer

    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is a {type(text).__name__}, not a str")
    if isinstance(source_or_model, nnx.Module):
        if tokenizer is None:
            raise TypeError("evaluate(model, ...) needs tokenizer= (a tokenizers.Tokenizer or a checkpoint location)")
        if options is not None or keywords:
            given = sorted(keywords) + (["options"] if options is not None else [])
            raise TypeError(f"load options {given} are for a checkpoint location, not a model")
        model, tok, load_seconds = source_or_model, as_tokenizer(tokenizer), 0.0
    else:
        load_options = resolve_options(options, keywords)
        if load_options.progress is None:
            load_options = dataclasses.replace(load_options, progress=progress)
        model, tok, load_seconds = load_with_tokenizer(source_or_model, tokenizer, options=load_options)
    if max_len is None:
        max_len = model_config(model).get("max_position_embeddings")
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len must be at least 1; got {max_len}")
    start = time.perf_counter()
    sequences, truncated = encode(tok, texts, max_len)
    nll, count, compile_seconds, lower_seconds = score(model, sequences, batch_size=batch_size, max_len=max_len,
                                                       progress=progress)
    seconds = time.perf_counter() - start
    return EvalResult(
        nll=float(nll.sum()), tokens=int(count.sum()), texts=len(texts),
        skipped=int(sum(len(s) < 2 for s in sequences)),
        truncated=truncated, max_len=max_len, batch_size=batch_size, load_seconds=load_seconds, eval_seconds=seconds,
        compile_seconds=compile_seconds, lower_seconds=lower_seconds,
        text_nll=tuple(nll.tolist()), text_tokens=tuple(count.tolist()),
    )

