"""What every GQA family's config shares, whichever family it is: the attention shape a config
gives (hidden size, heads, key/value heads, head dim; checked for consistency) and the checks of
those fields against the checkpoint's embedding and q/k projections."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from otfload.config import BOOL, EPS, HEAD_DIM, HEADS, HIDDEN, LAYERS, NAME, VOCAB, Count, Dim, Fields, require
from otfload.models.gqa import HeadShape


def attention_shape(f: Fields) -> tuple[int, int, int, int]:
    """``(hidden_size, heads, kv_heads, head_dim)`` of a GQA config, checked for consistency."""
    hidden, heads = f.get("hidden_size", HIDDEN), f.get("num_attention_heads", HEADS)
    kv_heads = f.get("num_key_value_heads", HEADS, heads)
    require(heads % kv_heads == 0, f.name("num_key_value_heads"), kv_heads,
            f"must divide num_attention_heads ({heads}): each key/value head serves a whole group of query heads")
    head_dim = f.get("head_dim", HEAD_DIM, None)
    if head_dim is None:
        require(hidden % heads == 0, f.name("hidden_size"), hidden,
                f"must be divisible by num_attention_heads ({heads}) when head_dim is not given")
        head_dim = hidden // heads
    require(head_dim % 2 == 0, f.name("head_dim"), head_dim, "must be even: RoPE rotates pairs of dimensions")
    return hidden, heads, kv_heads, head_dim


@dataclass(frozen=True)
class DecoderShape:
    """The fields every GQA decoder's config has, under ``config.json``'s names (a family's config
    extends it; :meth:`to_dict` feeds the mapping's hooks)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool

    @staticmethod
    def parse(f: Fields, *, eps: float = 1e-6, tied: bool = False) -> dict[str, Any]:
        """These fields of ``f`` checked (``eps`` and ``tied``: the family's defaults in
        transformers), as keyword arguments for the family's config."""
        hidden, heads, kv_heads, head_dim = attention_shape(f)
        return {"model_type": f.get("model_type", NAME), "vocab_size": f.get("vocab_size", VOCAB),
                "hidden_size": hidden, "num_hidden_layers": f.get("num_hidden_layers", LAYERS),
                "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
                "rms_norm_eps": f.get("rms_norm_eps", EPS, eps),
                "tie_word_embeddings": f.get("tie_word_embeddings", BOOL, tied)}

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, for the mapping table's hooks."""
        return dataclasses.asdict(self)


class AttentionConfig(HeadShape, Protocol):
    """The fields of a Llama-style attention config that :func:`attention_checks` compares
    (:class:`LlamaConfig`, and Gemma's, which shares their names)."""

    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...


def attention_checks(cfg: AttentionConfig, prefix: str = "model.") -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary, width and (kv) heads of a Llama-style config against the tensors
    under ``prefix``."""
    embed, attn = f"{prefix}embed_tokens.weight", f"{prefix}layers.{{layer}}.self_attn"
    per_head = ("head_dim", cfg.head_dim)
    return (
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
        Dim("vocab_size", cfg.vocab_size, embed, 0),
        Dim("hidden_size", cfg.hidden_size, embed, 1),
        Dim("num_attention_heads", cfg.num_attention_heads, f"{attn}.q_proj.weight", 0, per_head),
        Dim("num_key_value_heads", cfg.num_key_value_heads, f"{attn}.k_proj.weight", 0, per_head),
    )
