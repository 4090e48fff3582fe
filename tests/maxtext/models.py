"""The tiny models of the MaxText tests, described once for both sides: the transformers config the
main venv saves a checkpoint from (``make_refs.py``) and the MaxText ``pyconfig`` overrides that build
the same model in the MaxText venv. Plain data: importable by either venv.

MaxText takes its per-model settings (RoPE kind and base, norm epsilon, activations, tied embeddings)
from ``configs/models/<model_name>.yml``; the transformers side is given the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, LAYERS = 128, 64, 8, 4, 16, 128, 3
EXPERTS, TOP_K, MOE_MLP = 4, 2, 32
SEQ = 12

# llama3.1-8b.yml: rope_max_timescale 500_000 with MaxText's fixed Llama-3.1 scaling (factor 8, low 1,
# high 4, original context 8192: embeddings.LLaMARotaryEmbedding).
LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_theta": 500_000.0}


@dataclass(frozen=True)
class Family:
    """One tiny model: its MaxText ``model_name`` and the transformers classes and config beside it."""

    name: str
    model_name: str
    hf_config: str
    hf_model: str
    hf_extra: dict[str, Any] = field(default_factory=dict)
    maxtext_extra: dict[str, Any] = field(default_factory=dict)
    vocab: int = VOCAB
    tied: bool = False
    moe: bool = False
    # MaxText's vocab_size where it pads the checkpoint's embedding (more rows than the checkpoint's vocab)
    maxtext_vocab: int | None = None
    # the checkpoint of another family this one loads (the same weights in another MaxText config)
    same_checkpoint_as: str | None = None
    # buffers (by name suffix) that the checkpoint stores and randomize_ leaves as initialised
    random_buffers: tuple[str, ...] = ()
    # written a second time with its experts in MXFP4 (make_refs: ``<name>_mxfp4``), the float
    # checkpoint holding the dequantised values
    mxfp4: bool = False
    # also written with its projections in FP8 e4m3, 16 x 16 block scales (make_refs: ``<name>_fp8``), as
    # DeepSeek publishes its checkpoints (128 x 128)
    fp8: bool = False
    # the MaxText layouts test_maxtext_drop_in.py loads this family in (None: all of them; (): none, a test of its own)
    layouts: tuple[tuple[bool, int], ...] | None = None
    # a multimodal checkpoint: the outer config's own fields (the text model's config is its ``text_config``);
    # make_refs writes its tensors under transformers' module names, the layout MaxText's converter reads
    multimodal: dict[str, Any] | None = None
    # leaves (path suffixes) MaxText's own loader fills with other values than the checkpoint means
    maxtext_differs: tuple[str, ...] = ()
    # each layer's experts saved fused (make_refs: ``mlp.experts.gate_up_proj`` / ``down_proj``), as the
    # published Qwen3.5 bfloat16 checkpoints hold them (transformers saves them one tensor per expert)
    fused_experts: bool = False
    # stored buffers (by name suffix) set uniform in [0.5, 1.5): Gemma 4's layer_scalar, a factor near 1
    scalar_buffers: tuple[str, ...] = ()

    @property
    def checkpoint(self) -> str:
        """The folder (under make_refs.py's output) of this family's checkpoint and reference logits."""
        return self.same_checkpoint_as or self.name

    def hf_kwargs(self) -> dict[str, Any]:
        """The transformers config of the checkpoint."""
        base = dict(vocab_size=self.vocab, hidden_size=EMBED, intermediate_size=MLP, num_hidden_layers=LAYERS,
                    num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                    max_position_embeddings=128, tie_word_embeddings=self.tied)
        text = {**base, **self.hf_extra}
        return {"text_config": text, **self.multimodal} if self.multimodal else text

    def maxtext_kwargs(self, scan_layers: bool, param_scan_axis: int) -> dict[str, Any]:
        """The ``pyconfig.initialize`` overrides that make MaxText build the same model."""
        moe = dict(num_experts=EXPERTS, num_experts_per_tok=TOP_K, base_moe_mlp_dim=MOE_MLP) if self.moe else {}
        base = dict(model_name=self.model_name, override_model_config=True, base_emb_dim=EMBED,
                    base_num_query_heads=HEADS, base_num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                    base_mlp_dim=MOE_MLP if self.moe else MLP, base_num_decoder_layers=LAYERS,
                    vocab_size=self.maxtext_vocab or self.vocab, scan_layers=scan_layers,
                    param_scan_axis=param_scan_axis, **moe)
        return {**base, **self.maxtext_extra}


_QWEN3 = dict(rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}, rms_norm_eps=1e-6)
_MOE_HF = dict(moe_intermediate_size=MOE_MLP, num_experts=EXPERTS, num_experts_per_tok=TOP_K)

# MLA: heads 4, q and kv LoRA ranks 32 / 16, per head 16 (no RoPE) + 8 (RoPE) for q/k, 16 for v; the first
# layer dense, then MoE with one shared expert. The YaRN RoPE of deepseek3-671b.yml / deepseek2-16b.yml
# (factor 40 over 4096 positions, interleaved pairs; the softmax scaled by MaxText's mscale, as HF's
# mscale_all_dim does).
MLA_HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, DENSE_LAYERS, SHARED = 4, 32, 16, 16, 8, 16, 1, 1


def _mla(q_lora: int, mscale: float, v3: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformers config, MaxText overrides) of a tiny DeepSeek-V3 (``v3``) or V2."""
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": mscale, "mscale_all_dim": mscale, "rope_theta": 10_000.0}
    hf = dict(num_attention_heads=MLA_HEADS, num_key_value_heads=MLA_HEADS, q_lora_rank=q_lora or None,
              kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
              head_dim=ROPE, first_k_dense_replace=DENSE_LAYERS, n_routed_experts=EXPERTS,
              num_experts_per_tok=TOP_K, n_shared_experts=SHARED, moe_intermediate_size=MOE_MLP,
              rope_parameters=yarn, rms_norm_eps=1e-6, max_position_embeddings=163840)
    mt = dict(base_num_query_heads=MLA_HEADS, base_num_kv_heads=MLA_HEADS, q_lora_rank=q_lora,
              kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM,
              head_dim=NOPE + ROPE, first_num_dense_layers=DENSE_LAYERS, shared_experts=SHARED, base_mlp_dim=MLP)
    if v3:  # sigmoid routing over 2 groups of 2 experts, the best group kept; scores normalised, x 2.5
        hf.update(n_group=2, topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, rope_interleave=True)
        mt.update(n_routing_groups=2, topk_routing_group=1)
    else:  # softmax routing, greedy top-k, no normalisation
        hf.update(topk_method="greedy", n_group=1, topk_group=1, norm_topk_prob=False, routed_scaling_factor=1.0)
    return hf, mt


_V3_HF, _V3_MT = _mla(Q_LORA, 1.0, v3=True)
_V2_HF, _V2_MT = _mla(0, 0.707, v3=False)
# DeepSeek-V3.2: V3 plus the DSA indexer, 16 heads of 16 (8 rotated), top 4 of the 12 tokens (so the
# sparse mask matters); 16 heads make an exact tie of two keys' scores too rare to meet
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 16, 16, 4
_V32_HF = dict(_V3_HF, index_n_heads=INDEX_HEADS, index_head_dim=INDEX_DIM, index_topk=INDEX_TOPK)
_V32_MT = dict(_V3_MT, indexer_n_heads=INDEX_HEADS, indexer_head_dim=INDEX_DIM, indexer_topk=INDEX_TOPK)

# gpt-oss-20b.yml's YaRN (factor 32 over 4096 positions, rotate-half, no truncation), its clamped
# SwiGLU (limit 7) and sliding window (here 8, under the 12 tokens, so the window matters); 4 layers:
# two blocks of MaxText's scanned (sliding, full) pair.
GPT_OSS_LAYERS, WINDOW = 4, 8
_GPT_OSS_HF = dict(num_hidden_layers=GPT_OSS_LAYERS, intermediate_size=MOE_MLP, num_local_experts=EXPERTS,
                   num_experts_per_tok=TOP_K, sliding_window=WINDOW, rms_norm_eps=1e-5, swiglu_limit=7.0,
                   attention_bias=True, max_position_embeddings=131072,
                   rope_parameters={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                    "rope_theta": 150_000.0})
_GPT_OSS_MT = dict(base_num_decoder_layers=GPT_OSS_LAYERS, sliding_window_size=WINDOW)

# Gemma: hidden 48 (sqrt(48) is no bfloat16, so Gemma 3's bf16 embedding scale and Gemma 2's float32 one
# differ), a sliding window of 8 under the 12 tokens; query_pre_attn_scalar = head_dim, as gemma2-2b and
# gemma3-4b have it. Gemma 2's MaxText layer is a (sliding, global) pair of HF layers: 4 HF layers are 2;
# Gemma 3's 13 layers are two scanned blocks of six and one left over (gemma3-4b.yml's RoPE: 1e6 with
# linear scaling 8 globally, 1e4 locally). Soft-caps: Gemma2Config's defaults are gemma2-2b.yml's 50 / 30.
GEMMA_EMBED, GEMMA_MLP, GEMMA_WINDOW, GEMMA2_LAYERS, GEMMA3_LAYERS = 48, 96, 8, 4, 13
_GEMMA_HF = dict(hidden_size=GEMMA_EMBED, intermediate_size=GEMMA_MLP, sliding_window=GEMMA_WINDOW,
                 query_pre_attn_scalar=HEAD_DIM, rms_norm_eps=1e-6)
_GEMMA_MT = dict(base_emb_dim=GEMMA_EMBED, base_mlp_dim=GEMMA_MLP, sliding_window_size=GEMMA_WINDOW)
_GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}
_GEMMA3_VISION = dict(vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14), mm_tokens_per_image=4)

# OLMo 3: olmo3-7b.yml's YaRN (factor 8 over 8192 positions, theta 5e5, attention scaled by 0.1 ln 8 + 1) on
# every layer, as MaxText applies it (transformers per layer type: the same for both); 8 layers are two
# scanned blocks of MaxText's (3 sliding, 1 global) cycle; a window of 8.
OLMO3_LAYERS = 8
_OLMO3_YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "beta_fast": 32.0,
               "beta_slow": 1.0, "rope_theta": 500_000.0}
_OLMO3_HF = dict(num_hidden_layers=OLMO3_LAYERS, sliding_window=GEMMA_WINDOW, rms_norm_eps=1e-6,
                 max_position_embeddings=65536,
                 rope_parameters={"full_attention": _OLMO3_YARN, "sliding_attention": _OLMO3_YARN})

# Qwen3-Next: 8 layers are two scanned blocks of MaxText's (3 linear, 1 full) cycle; Gated DeltaNet of 2 key
# heads and 4 value heads of 8; qwen3-next-80b-a3b.yml's RoPE (1e7 on a quarter of each head), one shared expert.
_GDN = dict(linear_num_key_heads=2, linear_key_head_dim=8, linear_num_value_heads=4, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)
_QWEN3_NEXT_HF = dict(_MOE_HF, num_hidden_layers=OLMO3_LAYERS, shared_expert_intermediate_size=MOE_MLP,
                      norm_topk_prob=True, rms_norm_eps=1e-6, **_GDN,
                      rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                       "partial_rotary_factor": 0.25})
_QWEN3_NEXT_MT = dict(base_num_decoder_layers=OLMO3_LAYERS, gdn_num_key_heads=2, gdn_key_head_dim=8,
                      gdn_num_value_heads=4, gdn_value_head_dim=8, gdn_conv_kernel_dim=4)

# Gemma 4 26B (MoE): 6 layers, one block of MaxText's five sliding and one global layer (transformers makes
# the last one full too); global layers with head_dim 32, 4 kv heads and k = v (attention_k_eq_v /
# share_kv_projections); gemma4-26b.yml's RoPE (1e4 locally, 1e6 on a quarter of each global head), its
# soft-cap 30 and a window of 8; the shared expert mlp_dim wide, 4 routed experts of 32, top 2.
GEMMA4_LAYERS, GEMMA4_GLOBAL_HEAD_DIM = 6, 32
_GEMMA4_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * (GEMMA4_LAYERS // 6)
_GEMMA4_HF = dict(num_hidden_layers=GEMMA4_LAYERS, global_head_dim=GEMMA4_GLOBAL_HEAD_DIM,
                  num_global_key_value_heads=KV_HEADS, attention_k_eq_v=True, sliding_window=GEMMA_WINDOW,
                  layer_types=_GEMMA4_TYPES, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
                  rms_norm_eps=1e-6, enable_moe_block=True, num_experts=EXPERTS, top_k_experts=TOP_K,
                  moe_intermediate_size=MOE_MLP, hidden_activation="gelu_pytorch_tanh",
                  rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                      "rope_theta": 1_000_000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
_GEMMA4_MT = dict(base_num_decoder_layers=GEMMA4_LAYERS, global_head_dim=GEMMA4_GLOBAL_HEAD_DIM,
                  global_num_kv_heads=KV_HEADS, sliding_window_size=GEMMA_WINDOW, base_mlp_dim=MLP)
# Gemma 4 E2B (gemma4_small, unscanned only): 10 layers, two of MaxText's E2B periods (four sliding, one
# global), the last 5 reading the keys and values of layers 3 (sliding) and 4 (global) with a double-wide
# MLP; 8-wide per-layer inputs; values in the global layers too (attention_k_eq_v false).
GEMMA4_SMALL_LAYERS, GEMMA4_SHARED, GEMMA4_PLE = 10, 5, 8
_GEMMA4_SMALL_HF = dict(_GEMMA4_HF, num_hidden_layers=GEMMA4_SMALL_LAYERS, attention_k_eq_v=False,
                        num_global_key_value_heads=None, enable_moe_block=False, num_experts=None, top_k_experts=None,
                        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * (GEMMA4_SMALL_LAYERS // 5),
                        num_kv_shared_layers=GEMMA4_SHARED, hidden_size_per_layer_input=GEMMA4_PLE,
                        vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True)
_GEMMA4_SMALL_MT = dict(base_num_decoder_layers=GEMMA4_SMALL_LAYERS, global_head_dim=GEMMA4_GLOBAL_HEAD_DIM,
                        sliding_window_size=GEMMA_WINDOW, hidden_size_per_layer_input=GEMMA4_PLE,
                        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=GEMMA4_SHARED)
_GEMMA4_VISION = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                                         patch_size=4, position_embedding_size=16))

# Qwen3.5 (qwen3.5-35b-a3b): Qwen3-Next's tiny sizes, as the multimodal checkpoint (a one-layer vision tower
# never read). Text only, MaxText's M-RoPE is its 1-D RoPE (every section the same position): use_mrope off.
_QWEN3_5_HF = dict(_QWEN3_NEXT_HF, rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0,
                                                    "partial_rotary_factor": 0.25})
_QWEN3_5_VISION = dict(vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                          out_hidden_size=EMBED, patch_size=4), tie_word_embeddings=False)

# Llama 4 as llama4-17b-128e (Maverick's layer pattern): 8 layers, two of MaxText's scanned blocks of 4, every
# second layer MoE (4 experts of 32, top 1, a shared expert) and the others dense (mlp 128), every fourth NoPE;
# chunked attention over 8 of the 12 tokens (so the chunks matter); that yml's RoPE (theta 5e5, no scaling)
# and no qk norm. The multimodal checkpoint with a one-layer vision tower, never read.
LLAMA4_LAYERS, LLAMA4_CHUNK = 8, 8
_LLAMA4_HF = dict(num_hidden_layers=LLAMA4_LAYERS, intermediate_size=MOE_MLP, intermediate_size_mlp=MLP,
                  num_local_experts=EXPERTS, num_experts_per_tok=1, interleave_moe_layer_step=2,
                  attention_chunk_size=LLAMA4_CHUNK, use_qk_norm=False, rms_norm_eps=1e-5,
                  rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
_LLAMA4_MT = dict(base_num_decoder_layers=LLAMA4_LAYERS, base_mlp_dim=MLP, num_experts_per_tok=1,
                  chunk_attn_window_size=LLAMA4_CHUNK)
_LLAMA4_VISION = dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=28, patch_size=14, vision_output_dim=32,
                                         projector_input_dim=32, projector_output_dim=EMBED))

FAMILIES: dict[str, Family] = {f.name: f for f in [
    Family("llama", "llama3.1-8b", "LlamaConfig", "LlamaForCausalLM",
           hf_extra=dict(rope_parameters=LLAMA31_ROPE, rms_norm_eps=1e-5, max_position_embeddings=131072)),
    Family("qwen3", "qwen3-0.6b", "Qwen3Config", "Qwen3ForCausalLM", tied=True, hf_extra=_QWEN3),
    # MaxText's vocab_size above the checkpoint's: its Qwen converter pads the embedding with zero rows
    Family("qwen3_padded", "qwen3-0.6b", "Qwen3Config", "Qwen3ForCausalLM", tied=True, hf_extra=_QWEN3,
           maxtext_vocab=VOCAB + 32, same_checkpoint_as="qwen3"),
    Family("qwen3_moe", "qwen3-30b-a3b", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", moe=True,
           hf_extra=dict(_MOE_HF, norm_topk_prob=True, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0})),
    Family("mixtral", "mixtral-8x7b", "MixtralConfig", "MixtralForCausalLM", moe=True,
           hf_extra=dict(intermediate_size=MOE_MLP, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0})),
    Family("deepseek3", "deepseek3-671b", "DeepseekV3Config", "DeepseekV3ForCausalLM", moe=True, hf_extra=_V3_HF,
           maxtext_extra=_V3_MT, random_buffers=("e_score_correction_bias",), fp8=True),
    Family("deepseek32", "deepseek3.2-671b", "DeepseekV32Config", "DeepseekV32ForCausalLM", moe=True,
           hf_extra=_V32_HF, maxtext_extra=_V32_MT, random_buffers=("e_score_correction_bias",),
           layouts=((False, 1),)),  # MaxText's loader cannot load it scanned: test_maxtext_deepseek32.py
    Family("deepseek2", "deepseek2-16b", "DeepseekV2Config", "DeepseekV2ForCausalLM", moe=True, hf_extra=_V2_HF,
           maxtext_extra=_V2_MT),
    Family("gpt_oss", "gpt-oss-20b", "GptOssConfig", "GptOssForCausalLM", moe=True, hf_extra=_GPT_OSS_HF,
           maxtext_extra=_GPT_OSS_MT, mxfp4=True),
    Family("gemma2", "gemma2-2b", "Gemma2Config", "Gemma2ForCausalLM", tied=True,
           hf_extra=dict(_GEMMA_HF, num_hidden_layers=GEMMA2_LAYERS),
           maxtext_extra=dict(_GEMMA_MT, base_num_decoder_layers=GEMMA2_LAYERS // 2)),
    Family("gemma3", "gemma3-4b", "Gemma3Config", "Gemma3ForConditionalGeneration", tied=True,
           hf_extra=dict(_GEMMA_HF, num_hidden_layers=GEMMA3_LAYERS, rope_parameters=_GEMMA3_ROPE),
           maxtext_extra=dict(_GEMMA_MT, base_num_decoder_layers=GEMMA3_LAYERS), multimodal=_GEMMA3_VISION),
    # query_pre_attn_scalar 24, not head_dim 16 (as gemma-2-9b's 224 beside 256): MaxText's converter scales
    # the query by 1/sqrt(head_dim) all the same
    Family("gemma2_qpas", "gemma2-9b", "Gemma2Config", "Gemma2ForCausalLM", tied=True,
           hf_extra=dict(_GEMMA_HF, num_hidden_layers=GEMMA2_LAYERS, query_pre_attn_scalar=24),
           maxtext_extra=dict(_GEMMA_MT, base_num_decoder_layers=GEMMA2_LAYERS // 2), layouts=((False, 1),),
           maxtext_differs=("self_attention_local.query.kernel", "self_attention_global.query.kernel")),
    Family("olmo3", "olmo3-7b", "Olmo3Config", "Olmo3ForCausalLM", hf_extra=_OLMO3_HF,
           maxtext_extra=dict(base_num_decoder_layers=OLMO3_LAYERS, sliding_window_size=GEMMA_WINDOW)),
    # scanned, MaxText's dynamic loader cannot load it (test_maxtext_qwen3_next.py): unscanned only there
    Family("qwen3_next", "qwen3-next-80b-a3b", "Qwen3NextConfig", "Qwen3NextForCausalLM", moe=True,
           hf_extra=_QWEN3_NEXT_HF, maxtext_extra=_QWEN3_NEXT_MT, layouts=((False, 1),)),
    Family("gemma4", "gemma4-26b", "Gemma4Config", "Gemma4ForConditionalGeneration", tied=True, moe=True,
           hf_extra=_GEMMA4_HF, maxtext_extra=_GEMMA4_MT, multimodal=_GEMMA4_VISION, scalar_buffers=("layer_scalar",),
           layouts=()),  # test_maxtext_gemma4.py: MaxText's dynamic loader cannot load it
    Family("gemma4_small", "gemma4-e2b", "Gemma4Config", "Gemma4ForConditionalGeneration", tied=True,
           hf_extra=_GEMMA4_SMALL_HF, maxtext_extra=_GEMMA4_SMALL_MT, multimodal=_GEMMA4_VISION,
           scalar_buffers=("layer_scalar",), layouts=()),  # test_maxtext_gemma4.py: unscanned only
    # test_maxtext_qwen3_5.py only (every layout there)
    Family("qwen3_5", "qwen3.5-35b-a3b", "Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", moe=True,
           hf_extra=_QWEN3_5_HF, maxtext_extra=dict(_QWEN3_NEXT_MT, use_mrope=False), multimodal=_QWEN3_5_VISION,
           fused_experts=True, layouts=()),
    # test_maxtext_llama4.py only (MaxText has no Llama 4 converter mapping: no loader to compare with)
    Family("llama4", "llama4-17b-128e", "Llama4Config", "Llama4ForConditionalGeneration", moe=True,
           hf_extra=_LLAMA4_HF, maxtext_extra=_LLAMA4_MT, multimodal=_LLAMA4_VISION, layouts=()),
]}

# (scan_layers, param_scan_axis): every layout MaxText has.
LAYOUTS = [(True, 1), (True, 0), (False, 1)]


def layouts(family: Family) -> list[tuple[bool, int]]:
    """The layouts ``family`` is loaded in."""
    return list(LAYOUTS if family.layouts is None else family.layouts)
