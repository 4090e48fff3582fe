"""lm_eval's ``generate_until``: greedy continuations cut at stop sequences, in left-padded batches.

What lm_eval's HF backend does, step for step: the generation options of a request are normalised
(``until`` a list of stop strings, to which the EOS token's text is added; ``max_gen_toks`` or an
alias of it; greedy only), each context is encoded and cut on the left to ``max_length -
max_gen_toks`` ids, contexts are sorted longest first and batched, and each batch is decoded
greedily through the model's KV cache (:func:`otfload.generate.timed_generate`), a row ending at the
first of ``config.json``'s EOS ids as transformers' does. A row's new tokens are decoded (special
tokens skipped) and cut before the first occurrence of each stop string in turn.

Decoding stops early once every row of the batch has emitted EOS or contains a stop string (the
text before the first stop cannot change by decoding further). Prompts are left-padded to a width
chosen from the batch lengths (:mod:`otfload.lm_eval.buckets`), so few shapes are compiled; padding
is masked and positions count real tokens only, so it changes no row's tokens.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from otfload.errors import EvalRequestError
from otfload.generate import special_tokens, timed_generate
from otfload.lm_eval.buckets import choose_widths, width_for
from otfload.lm_eval.scoring import Timings
from otfload.lm_eval.tokens import CheckpointTokenizer
from otfload.models.base import CausalLM

# lm_eval's aliases of the number of tokens to generate, in the order it prefers them.
MAX_TOKENS_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")


@dataclass(frozen=True)
class GenerationOptions:
    """A request's ``gen_kwargs`` normalised: stop strings (EOS's text included) and token budget."""

    until: tuple[str, ...]
    max_gen_toks: int


def generation_options(gen_kwargs: Mapping[str, Any], default_max_gen_toks: int, eos_text: str | None
                       ) -> GenerationOptions:
    """Check and normalise one request's ``gen_kwargs`` as lm_eval's HF backend does; sampling is
    refused (this backend decodes greedily)."""
    kwargs = dict(gen_kwargs)
    until = kwargs.pop("until", None)
    if isinstance(until, str):
        until = [until]
    elif until is None:
        until = []
    elif not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise EvalRequestError(f"gen_kwargs 'until' must be a string or a list of strings; got {until!r}")
    if eos_text is not None and eos_text not in until:
        until = [*until, eos_text]
    budget = next((kwargs.pop(k) for k in MAX_TOKENS_KEYS if k in kwargs), default_max_gen_toks)
    for k in MAX_TOKENS_KEYS:
        kwargs.pop(k, None)
    if not isinstance(budget, int) or budget < 1:
        raise EvalRequestError(f"gen_kwargs max_gen_toks must be a positive integer; got {budget!r}")
    temperature = kwargs.pop("temperature", 0.0)
    do_sample = kwargs.pop("do_sample", None)
    if do_sample or (do_sample is None and temperature not in (0, 0.0, None)):
        raise EvalRequestError(f"gen_kwargs ask for sampling (do_sample={do_sample!r}, temperature={temperature!r});"
                               " the otfload backend decodes greedily")
    return GenerationOptions(tuple(until), budget)


def options_key(gen_kwargs: Mapping[str, Any]) -> str:
    """Requests with equal options are batched together (lm_eval groups by ``gen_kwargs``)."""
    return json.dumps(gen_kwargs, sort_keys=True, default=repr)


def cut_at_stops(text: str, until: Sequence[str]) -> str:
    """``text`` before the first occurrence of each stop string, applied in order (as lm_eval does)."""
    for stop in until:
        if stop:
            text = text.split(stop)[0]
    return text


class Generator:
    """Greedy ``generate_until`` for prompts already encoded, ``batch_size`` rows at a time. Its
    seconds go to ``timings``: getting the step programs (one per prompt width and phase, kept
    across jobs by :mod:`otfload.programs`) to ``compile_seconds`` and ``lower_seconds``, the
    rest of decoding to ``generate_seconds``."""

    def __init__(self, tokenizer: CheckpointTokenizer, batch_size: int, timings: Timings) -> None:
        self.tokenizer, self.batch_size, self.timings = tokenizer, batch_size, timings

    def run(self, model: CausalLM, prompts: Sequence[Sequence[int]], options: GenerationOptions,
            progress: Callable[[int], None] | None = None) -> list[str]:
        """The continuation of each prompt (in the order given), cut at the stop strings."""
        if any(not p for p in prompts):
            raise EvalRequestError("a generate_until context encodes to no token: nothing to continue from")
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        widths = choose_widths([len(prompts[b[0]]) for b in batches], max(len(p) for p in prompts))
        out = [""] * len(prompts)
        for batch in batches:
            rows = [prompts[i] for i in batch]
            texts = self._batch(model, rows, width_for(len(rows[0]), widths), options)
            for i, text in zip(batch, texts, strict=False):
                out[i] = text
            if progress is not None:
                progress(len(batch))
        return out

    def _batch(self, model: CausalLM, rows: list[Sequence[int]], width: int, options: GenerationOptions) -> list[str]:
        ids = np.zeros((self.batch_size, width), np.int32)
        mask = np.zeros(ids.shape, bool)
        for r, row in enumerate(rows):
            ids[r, width - len(row):], mask[r, width - len(row):] = row, True
        mask[len(rows):, -1] = True  # filler rows: one token
        eos = set(special_tokens(model, None, None)[0])  # transformers stops at config.json's EOS ids

        def stopped(new: np.ndarray) -> bool:
            return all(eos & set(new[r].tolist()) or self._has_stop(new[r], options.until) for r in range(len(rows)))

        start = time.perf_counter()
        generated = timed_generate(model, ids, options.max_gen_toks, mask, pad_token_id=self.tokenizer.pad_id,
                                   stop=stopped)
        out = np.asarray(generated.ids)
        # The step programs' seconds (key and kept program read, or tracing, lowering and XLA) are compiling.
        self.timings.compile_seconds += generated.compile_seconds
        self.timings.lower_seconds += generated.lower_seconds
        self.timings.generate_seconds += time.perf_counter() - start - generated.compile_seconds
        # After EOS a row holds the padding id; decoding skips both (special tokens), as lm_eval's does.
        return [cut_at_stops(self.tokenizer.decode(out[r, width:].tolist()), options.until) for r in range(len(rows))]

    def _has_stop(self, new: np.ndarray, until: Sequence[str]) -> bool:
        text = self.tokenizer.decode(new.tolist())
        return any(stop and stop in text for stop in until)
