"""A real tiny ``tokenizer.json`` for the tiny checkpoints, and transformers' loss as the reference.

The tokenizer is a BPE model trained with the ``tokenizers`` library on a few sentences (Metaspace
pre-tokenizer and decoder, as SentencePiece-style checkpoints ship them) whose post-processor adds
a BOS token, so texts go through the same normalize → pre-tokenize → model → post-process path as a
published tokenizer. Its ids stay below the tiny models' 256-row embedding.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

# The tiny tokenizer is otfload example's (its corpus, special tokens and size are the tests' too).
from otfload.examples import CORPUS, SPECIAL, VOCAB_SIZE, build_tokenizer  # noqa: F401

# Texts an eval job sends: seen and unseen words, an empty text (BOS only: nothing to predict),
# lengths from 2 to beyond the truncation length the tests use.
TEXTS = [
    "the quick brown fox",
    "",
    "a checkpoint is loaded on the fly into sharded arrays and the model predicts each token from the tokens "
    "before it",
    "zebra",
    "perplexity of the lazy dog",
    "evaluation jobs pull weights",
    "",
    "every process reads only the bytes its devices need, then the model predicts the rest",
]


def with_tokenizer(checkpoint: Path, dest: Path) -> Path:
    """A copy of ``checkpoint`` with the tiny ``tokenizer.json`` added."""
    shutil.copytree(checkpoint, dest, dirs_exist_ok=True)
    build_tokenizer(dest / "tokenizer.json")
    return dest


def reference_nll(torch_model, tokenizer_file: Path, texts: list[str], max_len: int | None) -> list[tuple[float, int]]:
    """Per text ``(summed nll, predicted tokens)`` the transformers way: the ids of transformers'
    ``PreTrainedTokenizerFast`` cut to ``max_len``, ``model(ids, labels=ids).loss`` (the mean over
    predicted tokens) times their count; ``(0, 0)`` for texts under two ids."""
    import torch
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file))
    out = []
    for text in texts:
        ids = tokenizer(text)["input_ids"][:max_len]
        if len(ids) < 2:
            out.append((0.0, 0))
            continue
        with torch.no_grad():
            t = torch.tensor([ids])
            loss = torch_model.float()(t, labels=t).loss.item()
        out.append((loss * (len(ids) - 1), len(ids) - 1))
    return out


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def as_arrays(ref: list[tuple[float, int]]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([r[0] for r in ref]), np.array([r[1] for r in ref])
