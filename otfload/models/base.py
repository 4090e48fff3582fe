"""The call interface every bundled causal LM shares: padding masks, positions and a KV cache.

``model(input_ids)`` → logits ``[b, s, vocab]``;
``model(input_ids, attention_mask=mask, positions=pos)`` the same for a padded batch (``mask [b, s]``,
1 = token, 0 = padding, left or right; ``positions`` are HF ``position_ids``, by default each real
token's index among its row's real tokens); with ``cache=model.init_cache(b, slots)`` the call
returns ``(logits, cache)`` with this call's keys and values written after the cached ones.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context, make_context
from otfload.models.layers import Dense, Embed, Norm

# ``{"index": [], "mask": [b, slots], "layers": {group: GroupCache}}`` (a pytree of arrays).
Cache = dict[str, Any]
# One layer group's cache: ``{"k": [layers, b, slots, kv_heads, k_dim], "v": ...}`` (``v`` absent when
# values are read from the keys); a layer's own slice has no leading layers axis.
GroupCache = dict[str, jax.Array]
# The per-group caches a model's :meth:`~CausalLM.forward` reads and returns.
GroupCaches = dict[str, GroupCache]
# A layer group's cache: (layers, kv heads, key dim, value dim; 0 = values are read from the keys).
CacheLayout = tuple[int, int, int, int]


class ModelConfig(Protocol):
    """What :class:`CausalLM` itself reads of a model's config (each family's config has more)."""

    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def pad_token_id(self) -> int | None: ...


class CausalLM(nnx.Module):
    """Base of the bundled models. Subclasses implement :meth:`forward` and :meth:`cache_layout`.

    ``attention_impl`` (``"chunked"``/``"dpa"``) and ``moe_impl`` (``"blocks"``/``"ragged"``/
    ``"dense"``) pick implementations; None takes the backend's default. Set them on a model
    (``model.moe_impl = "dense"``) to compare; they are static, so a change retraces.

    ``freeze_pad_row`` (default True) keeps the embedding row of the config's ``pad_token_id`` out
    of the gradient of the token lookup, as transformers' ``nn.Embedding(padding_idx=pad_token_id)``
    does (a tied output projection still trains it, there as here); set it False to train that row
    like any other. The models have no dropout: every published config of the bundled families sets
    ``attention_dropout`` (and Mixtral's ``router_jitter_noise``) to 0, and a config that does not
    is trained without them.

    ``packs_sequences`` (class-level, True here) says whether one row may hold several sequences
    (``make_context``'s ``segments``: lm-eval's packed scoring rows). Attention keeps them apart by
    its masks; a model with a recurrent layer (Gated DeltaNet, KDA, Mamba-2) sets it False, since its
    state and convolution window run along the whole row: such a model is scored one sequence a row.
    """

    packs_sequences: ClassVar[bool] = True
    attention_impl: str | None = None
    moe_impl: str | None = None
    freeze_pad_row: bool = True
    # Set by every subclass's ``__init__`` (which narrows ``cfg`` to its family's config): the config,
    # the token embedding and, for untied embeddings, the output projection.
    cfg: ModelConfig
    embed: Embed
    final_norm: Norm
    lm_head: Dense

    def __call__(
        self,
        input_ids: jax.Array | np.ndarray,
        attention_mask: jax.Array | np.ndarray | None = None,
        positions: jax.Array | np.ndarray | None = None,
        cache: Cache | None = None,
    ) -> jax.Array | tuple[jax.Array, Cache]:
        """Logits ``[b, s, vocab]``; ``(logits, cache)`` when a ``cache`` is given. ``input_ids``,
        ``attention_mask`` (int or bool) and ``positions`` may be numpy or jax arrays."""
        logits, new_cache = self.run(input_ids, attention_mask, positions, cache)
        return logits if new_cache is None else (logits, new_cache)  # run returns a cache iff given one

    def run(
        self,
        input_ids: jax.Array | np.ndarray,
        attention_mask: jax.Array | np.ndarray | None = None,
        positions: jax.Array | np.ndarray | None = None,
        cache: Cache | None = None,
        last_only: bool = False,
    ) -> tuple[jax.Array, Cache | None]:
        """``(logits, updated cache or None)``; ``last_only`` computes the logits of the last
        position only (``[b, 1, vocab]``: what a decoding step needs, without a ``[b, s, vocab]`` array)."""
        ids = jnp.asarray(input_ids)
        ctx = make_context(ids, attention_mask, positions, cache, self.attention_impl, self.moe_impl)
        x, layers = self.forward(ids, ctx, None if cache is None else cache["layers"])
        logits = self.head(x[:, -1:] if last_only else x)
        if cache is None:
            return logits, None
        assert ctx.cache_index is not None  # make_context sets it for a call with a cache
        return logits, {"index": ctx.cache_index + ids.shape[1], "mask": ctx.kv_mask, "layers": layers}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        """The final-normed hidden states of ``input_ids`` and the updated per-group layer caches
        (None without a cache)."""
        raise NotImplementedError

    def init_output(self, vocab_size: int, hidden_size: int, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        """Create the final norm and, for untied embeddings, the output projection ``lm_head``."""
        self.final_norm = Norm(hidden_size, dtype=dtype, rngs=rngs)
        if not self.cfg.tie_word_embeddings:
            self.lm_head = Dense((vocab_size, hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def embed_tokens(self, input_ids: jax.Array) -> jax.Array:
        """The embedding rows of ``input_ids``; with :attr:`freeze_pad_row`, no gradient reaches the
        pad token's row through them (its value is used as stored)."""
        x = self.embed.embedding[...][input_ids]
        pad = self.cfg.pad_token_id
        if pad is None or not self.freeze_pad_row:
            return x
        return jnp.where((input_ids == pad)[..., None], jax.lax.stop_gradient(x), x)

    def head(self, x: jax.Array) -> jax.Array:
        """Logits of final-normed hidden states ``x [b, s, hidden]`` (tied or untied ``lm_head``)."""
        embedding = self.embed.embedding[...]
        weight = embedding if self.cfg.tie_word_embeddings else self.lm_head.kernel[...]
        return jnp.einsum("bsh,vh->bsv", x, weight)

    def cache_layout(self) -> dict[str, CacheLayout]:
        """Each layer group's cache shape (see :data:`CacheLayout`)."""
        raise NotImplementedError

    def init_cache(self, batch: int, slots: int, dtype: DTypeLike | None = None) -> Cache:
        """An empty cache of ``slots`` key/value slots per row (prompt plus new tokens), in the
        embedding's dtype unless ``dtype`` is given."""
        dtype = self.embed.embedding.get_value().dtype if dtype is None else dtype
        layers: GroupCaches = {}
        for group, (n, kv_heads, k_dim, v_dim) in self.cache_layout().items():
            layers[group] = {"k": jnp.zeros((n, batch, slots, kv_heads, k_dim), dtype)}
            if v_dim:
                layers[group]["v"] = jnp.zeros((n, batch, slots, kv_heads, v_dim), dtype)
        return {"index": jnp.zeros((), jnp.int32), "mask": jnp.zeros((batch, slots), bool), "layers": layers}


class DecoderConfig(ModelConfig, Protocol):
    """What :class:`StackedDecoderLM` reads of a config (the fields every decoder config has)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class StackedDecoderLM(CausalLM):
    """A causal LM of ``num_hidden_layers`` layers of one kind (:attr:`layer_class`, made with
    :attr:`layer_options`): the embedding, the layers (stacked to scan, or a list), the final norm
    and, untied, ``lm_head``; one key/value cache group ``"layers"``. Subclasses write
    :meth:`~CausalLM.forward` (and may override :meth:`init_layers`)."""

    layer_class: ClassVar[Callable[..., nnx.Module]]
    layer_options: ClassVar[Mapping[str, Any]] = {}
    cfg: DecoderConfig
    layers: nnx.Module  # one stacked decoder layer (``scan_layers``) or an ``nnx.List`` of layers

    def __init__(
        self, cfg: DecoderConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.init_layers(dtype, rngs)
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def init_layers(self, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        """Create ``self.layers``: :attr:`layer_class` stacked (scanned) or a list of them."""
        make = partial(type(self).layer_class, self.cfg, dtype=dtype, rngs=rngs, **self.layer_options)
        self.layers = layer_stack(make, self.cfg.num_hidden_layers, self.scan_layers)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {"layers": (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)}


def layer_stack(make: Callable[..., nnx.Module], count: int, scan_layers: bool) -> nnx.Module:
    """``count`` decoder layers: one layer stacked ``count`` deep (``make(stack=count)``) to scan, or
    an ``nnx.List`` of ``count`` ``make()`` layers."""
    return make(stack=count) if scan_layers else nnx.List([make() for _ in range(count)])


def group_cache(caches: Mapping[str, GroupCache] | None, group: str) -> GroupCache | None:
    """One group's cache (None without a cache)."""
    return None if caches is None else caches[group]
