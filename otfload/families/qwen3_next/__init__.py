"""The Qwen3-Next family (``qwen3_next``, ``Qwen3NextForCausalLM``): Gated DeltaNet and gated
attention layers as Qwen3.5's (:mod:`otfload.models.hybrid_decoder`), the linear layers' projections
fused per key head, routed experts with a gated shared expert on every ``decoder_sparse_step``-th
layer but ``mlp_only_layers``, dense MLPs on the others.

``config`` parses ``config.json``, ``mapping`` holds the table and checks; importing the package
registers the family."""

from otfload.families.lora import QWEN2_MOE
from otfload.families.qwen3_next.config import Qwen3NextConfig
from otfload.families.qwen3_next.mapping import qwen3_next_checks, qwen3_next_table
from otfload.families.registry import Family, register
from otfload.models.hybrid_decoder import HybridForCausalLM

QWEN3_NEXT = register(
    Family(
        name="qwen3_next",
        model_types=("qwen3_next",),
        parse_config=Qwen3NextConfig.from_hf,
        build=HybridForCausalLM,
        mapping=qwen3_next_table,
        checks=qwen3_next_checks,
        lora_layout=QWEN2_MOE,  # PEFT names the experts fused (gate_up_proj), as transformers runs them
    )
)

__all__ = ["QWEN3_NEXT", "Qwen3NextConfig"]
