"""What every GQA family's config shares, whichever family it is: the attention shape a config
gives (hidden size, heads, key/value heads, head dim; checked for consistency) and the checks of
those fields against the checkpoint's embedding and q/k projections."""

from __future__ import annotations

from typing import Protocol

from otfload.config import HEAD_DIM, HEADS, HIDDEN, Count, Dim, Fields, require
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
