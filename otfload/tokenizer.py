"""The checkpoint's own tokenizer: ``tokenizer.json`` fetched from the same source as the weights.

    tokenizer = load_tokenizer("meta-llama/Llama-3.2-1B")     # or a Source, a directory, gs://...
    ids = tokenizer.encode("Hello").ids                        # special tokens as its post-processor adds them

The file is read through the source abstraction (local directory, Hub, ``gs://``, any fsspec URL),
so an eval job needs nothing besides the location of the checkpoint. It is loaded with the
``tokenizers`` library (the "fast" tokenizer transformers wraps) and its own truncation and padding
settings are switched off, as transformers' ``tokenizer(text)`` does when not asked for them: a
text becomes exactly the ids its normalizer, pre-tokenizer, model and post-processor give.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, TypeAlias

from otfload.errors import TokenizerError, TokenizerNotFoundError
from otfload.sources import Source, read_bytes
from otfload.sources.owned import owned_source

if TYPE_CHECKING:  # tokenizers is imported when first used: it is not needed to load weights
    from tokenizers import Tokenizer

TOKENIZER_FILE = "tokenizer.json"
# Largest tokenizer.json accepted: published ones are 2-35 MB (Gemma 3's 262k-token vocabulary is
# the largest); a much larger file is not a tokenizer, and must not be read into memory unbounded.
MAX_TOKENIZER_BYTES = 1 << 30
# What a ``tokenizer=`` argument may be: a tokenizer, or a location holding its ``tokenizer.json``.
TokenizerSpec: TypeAlias = "Tokenizer | str | os.PathLike[str] | Source"


def load_tokenizer(location: str | os.PathLike[str] | Source, **source_options: Any) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` of the checkpoint at ``location`` (a :class:`Source` or anything
    :func:`~otfload.sources.open_source` opens, with its ``source_options``).

    Raises :class:`TokenizerNotFoundError` when the source has no ``tokenizer.json`` and
    :class:`TokenizerError` when the file is not one the ``tokenizers`` library can load.
    """
    with owned_source(location, **source_options) as source:
        return tokenizer_from_source(source)


def tokenizer_from_source(source: Source) -> Tokenizer:
    """The tokenizer in ``tokenizer.json`` of an open ``source`` (left open)."""
    from tokenizers import Tokenizer

    if TOKENIZER_FILE not in source.list_files():
        raise TokenizerNotFoundError(
            f"{TOKENIZER_FILE} not found in {source.description}: scoring and generating text need the "
            "checkpoint's fast-tokenizer file (or, in Python, tokenizer= a tokenizers.Tokenizer)"
        )
    size = source.size(TOKENIZER_FILE)
    if size > MAX_TOKENIZER_BYTES:
        raise TokenizerError(f"{TOKENIZER_FILE} in {source.description}: {size} bytes is too large for a tokenizer")
    data = read_bytes(source, TOKENIZER_FILE)
    try:
        tokenizer = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # tokenizers raises plain Exception for every parse error
        raise TokenizerError(f"{TOKENIZER_FILE} in {source.description}: not a tokenizer the tokenizers "
                             f"library can load ({e})") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def as_tokenizer(tokenizer: TokenizerSpec, **source_options: Any) -> Tokenizer:
    """``tokenizer`` itself when it is a ``tokenizers.Tokenizer``, else the one at that location."""
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return load_tokenizer(tokenizer, **source_options)
