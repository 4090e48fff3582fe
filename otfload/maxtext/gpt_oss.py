"""MaxText's GPT-OSS (``decoder_block: gpt_oss``, ``gpt-oss-20b/120b``): attention ``GptOssAttention``
with q/k/v/out biases and the per-head ``sinks``, HF's rotate-half RoPE order and no query pre-scale
(MaxText's attention scales by ``head_dim ** -0.5`` itself); MoE ``GptOssMlp``: the router ``gate``
(kernel and bias) and the experts as HF fuses them, ``gate_up_proj [E, embed, 2 * mlp]`` with gate
and up interleaved on the last axis, so ``wi_0`` is ``[..., ::2]`` and ``wi_1`` ``[..., 1::2]``
(MaxText's converter's ``interleave`` hook; their biases alike), ``down_proj`` ``wo`` as stored
(experts are ``[in, out]`` in HF already: nothing is transposed). The published MXFP4 experts
(``*_blocks`` / ``*_scales``) are decoded by otfload's index as the tensors they stand for.

Scanned, MaxText stacks a block of ``inhomogeneous_layer_cycle_interval`` (2: sliding then full
attention) layers: ``decoder.layers.layers_<j>`` holds HF layers ``j, j + 2, ...``; unscanned trees
are ``decoder.layers_<i>``. The experts' own axis is part of each HF tensor, so the layer axis sits
at ``param_scan_axis`` of every leaf (``wi_0 [E, layers, embed, mlp]`` at 1).
"""

from __future__ import annotations

from otfload.maxtext.tables import (
    ATTN,
    HF_LAYER,
    Leaf,
    attention,
    attention_biases,
    cycle_table,
    kernel,
    layer_norms,
)
from otfload.plan.hooks import Slice

_ATTN, _MLP = "GptOssAttention", "GptOssMlp"
_X = f"{HF_LAYER}.mlp.experts"
LAYERS_PER_BLOCK = 2  # gpt-oss-20b.yml / 120b.yml; the table is written for two groups
_EXPERT_IN = ("mt_num_experts", "mt_emb_dim", "mt_mlp_dim")


def _half(name: str, source: str, start: int, shape: tuple[str, ...], axes: tuple[str | None, ...]) -> Leaf:
    """Gate (``start`` 0) or up (1) of HF's interleaved fused ``source``."""
    return Leaf(f"{_MLP}.{name}", source, (Slice(-1, start, None, 2),), shape, axes)


_LEAVES = (
    *layer_norms(),
    *attention(rope_interleaved=False, query_scaled=False, module=_ATTN),
    *attention_biases(_ATTN),
    Leaf(f"{_ATTN}.out.bias", f"{ATTN}.o_proj.bias", (), ("mt_emb_dim",), ("fsdp",)),
    Leaf(f"{_ATTN}.sinks", f"{ATTN}.sinks", (), ("mt_num_query_heads",), (None,)),
    kernel(f"{_MLP}.gate.kernel", f"{HF_LAYER}.mlp.router.weight", ("mt_emb_dim", "mt_num_experts"), ("fsdp", None)),
    Leaf(f"{_MLP}.gate.bias", f"{HF_LAYER}.mlp.router.bias", (), ("mt_num_experts",), (None,)),
    _half("wi_0", f"{_X}.gate_up_proj", 0, _EXPERT_IN, (None, "fsdp", "tensor")),
    _half("wi_1", f"{_X}.gate_up_proj", 1, _EXPERT_IN, (None, "fsdp", "tensor")),
    _half("wi_0_bias", f"{_X}.gate_up_proj_bias", 0, ("mt_num_experts", "mt_mlp_dim"), (None, "tensor")),
    _half("wi_1_bias", f"{_X}.gate_up_proj_bias", 1, ("mt_num_experts", "mt_mlp_dim"), (None, "tensor")),
    Leaf(f"{_MLP}.wo", f"{_X}.down_proj", (), ("mt_num_experts", "mt_mlp_dim", "mt_emb_dim"), (None, "tensor", "fsdp")),
    Leaf(f"{_MLP}.wo_bias", f"{_X}.down_proj_bias", (), ("mt_num_experts", "mt_emb_dim"), (None, "tensor")),
)

GPT_OSS = cycle_table("gpt_oss", "gpt_oss", _LEAVES, LAYERS_PER_BLOCK)
