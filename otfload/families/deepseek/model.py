"""The DeepSeek-V2/V3 decoder: :class:`~otfload.models.mla_decoder.MlaForCausalLM` (multi-head latent
attention, :mod:`otfload.models.mla`; dense then routed MoE layers with shared experts,
:mod:`otfload.models.deepseek_moe`), mirroring transformers 5.23.

* RoPE: DeepSeek's interleaved pair layout (V2 always, V3 when ``rope_interleave``); YaRN scaling
  and its softmax ``mscale``.
* Routing: V2 softmax scores with greedy or group-limited greedy top-k; V3 sigmoid scores with
  ``e_score_correction_bias``, group selection by the sum of each group's top-2 and optional
  ``norm_topk_prob``. Both scale the chosen weights by ``routed_scaling_factor``.
"""

from otfload.models.mla_decoder import MlaForCausalLM


class DeepseekForCausalLM(MlaForCausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for DeepSeek-V2/V3 (and Kimi-K2)."""


__all__ = ["DeepseekForCausalLM"]
