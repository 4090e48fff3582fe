"""Flax NNX decoder for Qwen3.5's text model: :mod:`otfload.models.hybrid_decoder`'s, whose Gated
DeltaNet layers keep the projections as Qwen3.5 stores them (``qkv`` fused by kind, ``z``, ``a``,
``b`` by value head), in two groups, ``linear_layers`` and ``attention_layers``."""

from __future__ import annotations

from otfload.families.qwen3_5.config import Qwen35Config
from otfload.models.hybrid_decoder import HybridForCausalLM


class Qwen35ForCausalLM(HybridForCausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Qwen3.5's text model."""

    cfg: Qwen35Config
