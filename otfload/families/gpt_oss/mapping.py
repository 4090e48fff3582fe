"""GPT-OSS's mapping table: the Llama attention keys (with biases) plus ``self_attn.sinks``, the
biased router, and the fused experts. ``gate_up_proj [E, hidden, 2 * inter]`` is stored in x out
with gate and up interleaved on the last axis, so the ``gate`` leaf takes ``[..., ::2]`` and ``up``
``[..., 1::2]``: each shard needs only its columns (in MXFP4, every other 1,440-byte row of the
stored blocks), and the two leaves, siblings of one stride-2 slice, split the pages that hold rows
of both (:func:`otfload.read.reader.charged_page_bytes`); ``down_proj [E, inter, hidden]`` is as is. The
model keeps these expert kernels in x out (``experts_in_first``) and the router ``[E, hidden]`` as
stored, so no tensor is transposed. LoRA adapters trained on transformers 5 name the same fused
parameters, laid out ``[E, in, out]`` (``GPT_OSS_LORA``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import LLAMA_STYLE_TABLE as LLAMA_TABLE
from otfload.families.gqa_shape import attention_checks
from otfload.families.lora import ExpertLayout
from otfload.families.mixtral.config import MoeConfig
from otfload.plan.hooks import Slice
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
X = f"{L}.mlp.experts"
GATE, UP = Slice(-1, 0, None, 2), Slice(-1, 1, None, 2)

GPT_OSS_TABLE = MappingTable(
    rules=(
        Rule("layers.{layer}.attn.sinks", f"{L}.self_attn.sinks"),
        Rule("layers.{layer}.moe.router.kernel", f"{L}.mlp.router.weight"),
        Rule("layers.{layer}.moe.router.bias", f"{L}.mlp.router.bias"),
        Rule("layers.{layer}.moe.gate.kernel", f"{X}.gate_up_proj", (GATE,)),
        Rule("layers.{layer}.moe.gate.bias", f"{X}.gate_up_proj_bias", (GATE,)),
        Rule("layers.{layer}.moe.up.kernel", f"{X}.gate_up_proj", (UP,)),
        Rule("layers.{layer}.moe.up.bias", f"{X}.gate_up_proj_bias", (UP,)),
        Rule("layers.{layer}.moe.down.kernel", f"{X}.down_proj"),
        Rule("layers.{layer}.moe.down.bias", f"{X}.down_proj_bias"),
    ),
) + LLAMA_TABLE

GPT_OSS_LORA = ExpertLayout(transposed=True)


def gpt_oss_checks(cfg: MoeConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The Llama checks plus the expert count against the router's and fused experts' leading axis."""
    return (
        *attention_checks(cfg),
        Dim("num_local_experts", cfg.num_experts, f"{L}.mlp.router.weight", 0),
        Dim("num_local_experts", cfg.num_experts, f"{X}.gate_up_proj", 0),
    )
