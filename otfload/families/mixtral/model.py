"""The sparse mixture-of-experts decoder Mixtral introduced: the Llama model with
:mod:`otfload.models.moe`'s decoder layers; Qwen3-MoE and GPT-OSS build theirs from it too (their
packages parse their configs into a :class:`~otfload.families.mixtral.config.MoeConfig` and map
their checkpoints onto this model).

Layers whose feed-forward is an MoE (``cfg.moe_layers``) and dense SwiGLU layers
(``cfg.dense_layers``) form two groups, ``layers`` and ``dense_layers``; with ``scan_layers`` each
group is one stack, run in HF layer order one homogeneous run at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.llama.model import LlamaForCausalLM
from otfload.families.mixtral.config import MoeConfig
from otfload.models.attention import Context, Window
from otfload.models.base import CacheLayout, GroupCache, GroupCaches, layer_stack
from otfload.models.decoder import DecoderLayer, layer_forward
from otfload.models.layers import Params, pure, run_layers
from otfload.models.moe import MoeDecoderLayer, moe_forward


def layer_runs(cfg: MoeConfig) -> list[tuple[str, int, int, int]]:
    """Maximal runs of consecutive layers in one group: ``(group, first position, stop position,
    first HF layer)``, in HF layer order."""
    runs: list[tuple[str, int, int, int]] = []
    for layer in range(cfg.num_hidden_layers):
        group, ids = ("layers", cfg.moe_layers) if layer in cfg.moe_layers else ("dense_layers", cfg.dense_layers)
        pos = ids.index(layer)
        if runs and runs[-1][0] == group and runs[-1][2] == pos:
            runs[-1] = (group, runs[-1][1], pos + 1, runs[-1][3])
        else:
            runs.append((group, pos, pos + 1, layer))
    return runs


class MoeForCausalLM(LlamaForCausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for an MoE decoder."""

    cfg: MoeConfig
    dense_layers: nnx.Module  # like ``layers``, of the dense layers (absent when there are none)

    def init_layers(self, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        """``layers`` (the MoE layers) and, when the config has any, ``dense_layers``."""
        self.layers = self._group(MoeDecoderLayer, len(self.cfg.moe_layers), dtype, rngs)
        if self.cfg.dense_layers:
            self.dense_layers = self._group(DecoderLayer, len(self.cfg.dense_layers), dtype, rngs)

    def _group(
        self, layer_cls: type[MoeDecoderLayer] | type[DecoderLayer], n: int, dtype: DTypeLike, rngs: nnx.Rngs | None
    ) -> nnx.Module:
        return layer_stack(partial(layer_cls, self.cfg, dtype=dtype, rngs=rngs), n, self.scan_layers)

    def _params(self, group: str, start: int, stop: int) -> Params | list[Params]:
        layers = self.layers if group == "layers" else self.dense_layers
        if isinstance(layers, nnx.List):
            return [pure(layers[i]) for i in range(start, stop)]
        sliced: Params = jax.tree.map(lambda a: a[start:stop], pure(layers))
        return sliced

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        shape = (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
        layout = {"layers": (len(cfg.moe_layers), *shape)}
        if cfg.dense_layers:
            layout["dense_layers"] = (len(cfg.dense_layers), *shape)
        return layout

    def decode(
        self, x: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        rope = self.rope(ctx.positions)
        sliding = range(cfg.num_hidden_layers) if cfg.sliding_layers is None else cfg.sliding_layers
        # Each layer's window (0: full attention): a static int when all layers share it, else one
        # per layer (numpy, so unscanned layers still see a static window).
        windows = np.array([(cfg.sliding_window or 0) if i in sliding else 0 for i in range(cfg.num_hidden_layers)],
                           np.int32)
        shared = int(windows[0]) if (windows == windows[0]).all() else None

        def forward(
            p: Params, h: jax.Array, xs: tuple[Window, GroupCache | None]
        ) -> tuple[jax.Array, GroupCache | None]:
            window, cache = xs
            ffn = (lambda q, y: moe_forward(q["moe"], y, cfg, ctx.moe_impl)) if "moe" in p else None
            return layer_forward(p, h, cfg, rope, ctx, cache, window if shared is None else shared, ffn)

        pieces: dict[str, list[GroupCache | None]] = {}
        for group, start, stop, first in layer_runs(cfg):
            cache = None if caches is None else jax.tree.map(lambda a, i=start, j=stop: a[i:j], caches[group])
            xs = (windows[first : first + stop - start], cache)
            x, new = run_layers(self._params(group, start, stop), x, forward, xs)
            pieces.setdefault(group, []).append(new)
        if caches is None:
            return x, None
        return x, {group: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for group, parts in pieces.items()}
