"""Tiny HF checkpoints for the MaxText tables, their MaxText configs, and MaxText's layouts built
with numpy from the HF tensors — the reference, written from MaxText's converter
(``checkpoint_conversion/utils/param_mapping.py``: kernels ``[in, out]`` with heads split, Llama
3.1's q/k halves interleaved and its query and Mixtral's scaled by ``float32(1/sqrt(head_dim))``,
the embedding zero-padded to ``vocab_size``, layers stacked at ``param_scan_axis``, experts leading)."""

from __future__ import annotations

import numpy as np

from tests.helpers import register_hf_model
from tests.maxtext_tables.grouped import grouped_layers
from tests.maxtext_tables.grouped import kernel as _kernel

DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16, max_position_embeddings=128)
MOE = dict(DIMS, intermediate_size=32)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16, "rope_theta": 500000.0}
    return LlamaForCausalLM(LlamaConfig(**{**DIMS, "rope_parameters": rope, **kw}))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**DIMS, **kw}))


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**{**DIMS, **kw}))


def _qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**MOE, "num_experts": 4, "num_experts_per_tok": 2,
                                                 "moe_intermediate_size": 32, **kw}))


def _mixtral(**kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**{**MOE, "num_local_experts": 4, "num_experts_per_tok": 2, **kw}))


MLA = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
           moe_intermediate_size=32)


# DeepSeek-V3.2's indexer: 4 heads of 16 (8 of them rotated, the MLA's qk_rope_head_dim)
INDEXER = dict(index_n_heads=4, index_head_dim=16, index_topk=4)


def _deepseek(version: int, **kw):
    import torch
    import transformers

    if version == 2:
        return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**DIMS, **MLA, "q_lora_rank": None,
                                                                                   **kw}))
    name, extra = ("DeepseekV32", INDEXER) if version == 32 else ("DeepseekV3", {})
    config = getattr(transformers, f"{name}Config")(**{**DIMS, **MLA, "q_lora_rank": 32, "n_group": 2,
                                                       "topk_group": 1, **extra, **kw})
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():  # a stored buffer randomize_ leaves at zeros
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
    return model


def _gpt_oss(**kw):
    from transformers import GptOssConfig, GptOssForCausalLM

    return GptOssForCausalLM(GptOssConfig(**{**MOE, "num_hidden_layers": 4, "num_local_experts": 4,
                                             "num_experts_per_tok": 2, **kw}))


register_hf_model("mt_llama", _llama)
# head_dim 32: the query scale 1/sqrt(32) is no power of two, so its rounding shows
register_hf_model("mt_llama_bf16", _llama, {"head_dim": 32}, dtype="bfloat16")
register_hf_model("mt_qwen2", _qwen2)
register_hf_model("mt_qwen3", _qwen3, {"tie_word_embeddings": True})
register_hf_model("mt_qwen3_moe", _qwen3_moe)
register_hf_model("mt_mixtral", _mixtral)
register_hf_model("mt_deepseek3", lambda **kw: _deepseek(3, **kw))
register_hf_model("mt_deepseek32", lambda **kw: _deepseek(32, **kw))
register_hf_model("mt_deepseek2", lambda **kw: _deepseek(2, **kw))
register_hf_model("mt_gpt_oss", _gpt_oss)

# checkpoint kind -> MaxText model_name
MODELS = {"mt_llama": "llama3.1-8b", "mt_qwen2": "qwen2.5-7b", "mt_qwen3": "qwen3-0.6b",
          "mt_qwen3_moe": "qwen3-30b-a3b", "mt_mixtral": "mixtral-8x7b", "mt_deepseek3": "deepseek3-671b",
          "mt_deepseek32": "deepseek3.2-671b", "mt_deepseek2": "deepseek2-16b", "mt_gpt_oss": "gpt-oss-20b"}
GROUPED = ("mt_deepseek3", "mt_deepseek32", "mt_deepseek2", "mt_gpt_oss")
LAYOUTS = [(True, 1), (True, 0), (False, 1)]  # (scan_layers, param_scan_axis)


def cycled_layers(layers: list[dict[str, np.ndarray]], cfg: dict, period: int, block: str) -> dict[str, np.ndarray]:
    """The decoder's layer leaves of a table scanned in a cycle of ``period`` layers: unscanned
    ``decoder.layers_<i>.*``; scanned ``decoder.layers.<block><j>.*`` stacking HF layers j, j + period, ...
    at ``param_scan_axis``."""
    if not cfg["scan_layers"]:
        return {f"decoder.layers_{i}.{k}": v for i, leaves in enumerate(layers) for k, v in leaves.items()}
    return {f"decoder.layers.{block}{j}.{k}": np.stack([x[k] for x in layers[j::period]], cfg["param_scan_axis"])
            for j in range(period) for k in layers[j]}


def maxtext_config(kind: str, scan_layers: bool, param_scan_axis: int, **over) -> dict:
    """The MaxText fields of a run on checkpoint ``kind`` (what its pyconfig would hold)."""
    moe = kind in ("mt_qwen3_moe", "mt_mixtral", "mt_gpt_oss")
    cfg = dict(model_name=MODELS[kind.removesuffix("_bf16").removesuffix("_mxfp4")], scan_layers=scan_layers,
               param_scan_axis=param_scan_axis, vocab_size=256, emb_dim=64, num_query_heads=8, num_kv_heads=4,
               head_dim=16, mlp_dim=32 if moe else 128, num_decoder_layers=3, num_experts=4 if moe else 1,
               moe_mlp_dim=32, logits_via_embedding=kind == "mt_qwen3")
    if kind.startswith("mt_deepseek"):  # MaxText's MLA fields, the checkpoint's sizes
        cfg.update(num_query_heads=4, num_kv_heads=4, head_dim=24, num_experts=4, kv_lora_rank=16,
                   qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_num_dense_layers=1,
                   shared_experts=1, q_lora_rank=0 if kind == "mt_deepseek2" else 32)
    if kind == "mt_deepseek32":
        cfg.update(indexer_n_heads=INDEXER["index_n_heads"], indexer_head_dim=INDEXER["index_head_dim"])
    if kind.startswith("mt_gpt_oss"):
        cfg.update(num_decoder_layers=4, inhomogeneous_layer_cycle_interval=2)
    return {**cfg, **over}


def _interleave(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.stack([x[..., :half], x[..., half:]], axis=-1).reshape(x.shape)


def _scaled(x: np.ndarray, head_dim: int) -> np.ndarray:
    return (x.astype(np.float32) * np.float32(1 / np.sqrt(head_dim))).astype(x.dtype)


def _pad(x: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return np.pad(x, widths)


def layer(kind: str, hf: dict[str, np.ndarray], i: int, cfg: dict) -> dict[str, np.ndarray]:
    """Layer ``i``'s MaxText leaves (one slice each; experts stacked on the leading axis)."""
    p, h, hd = f"model.layers.{i}", cfg["emb_dim"], cfg["head_dim"]
    q = _kernel(hf[f"{p}.self_attn.q_proj.weight"], h, cfg["num_query_heads"], hd)
    k = _kernel(hf[f"{p}.self_attn.k_proj.weight"], h, cfg["num_kv_heads"], hd)
    if kind.startswith("mt_llama"):
        q, k = _scaled(_interleave(q), hd), _interleave(k)
    elif kind == "mt_mixtral":
        q = _scaled(q, hd)
    out = {
        "pre_self_attention_layer_norm.scale": hf[f"{p}.input_layernorm.weight"],
        "post_self_attention_layer_norm.scale": hf[f"{p}.post_attention_layernorm.weight"],
        "self_attention.query.kernel": q,
        "self_attention.key.kernel": k,
        "self_attention.value.kernel": _kernel(hf[f"{p}.self_attn.v_proj.weight"], h, cfg["num_kv_heads"], hd),
        "self_attention.out.kernel": _kernel(hf[f"{p}.self_attn.o_proj.weight"], cfg["num_query_heads"], hd, h),
    }
    if kind == "mt_qwen2":
        for name, proj, heads in (("query", "q_proj", "num_query_heads"), ("key", "k_proj", "num_kv_heads"),
                                  ("value", "v_proj", "num_kv_heads")):
            out[f"self_attention.{name}.bias"] = hf[f"{p}.self_attn.{proj}.bias"].reshape(cfg[heads], hd)
    if kind.startswith("mt_qwen3"):
        out["self_attention.query_norm.scale"] = hf[f"{p}.self_attn.q_norm.weight"]
        out["self_attention.key_norm.scale"] = hf[f"{p}.self_attn.k_norm.weight"]
    if kind in ("mt_qwen3_moe", "mt_mixtral"):
        qwen = kind == "mt_qwen3_moe"
        block, router, names = (("moe_block", f"{p}.mlp", ("gate_proj", "up_proj", "down_proj")) if qwen
                                else ("MoeBlock_0", f"{p}.block_sparse_moe", ("w1", "w3", "w2")))
        out[f"{block}.gate.kernel"] = hf[f"{router}.gate.weight"].T
        for leaf, name in zip(("wi_0", "wi_1", "wo"), names, strict=True):
            out[f"{block}.{leaf}"] = np.stack([hf[f"{router}.experts.{e}.{name}.weight"].T
                                               for e in range(cfg["num_experts"])])
    else:
        for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
            out[f"mlp.{leaf}.kernel"] = hf[f"{p}.mlp.{name}.weight"].T
    return out


def expected(kind: str, hf: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """Every MaxText leaf (dotted path → array) for the layout ``cfg`` names."""
    vocab = cfg["vocab_size"]
    out = {"token_embedder.embedding": _pad(hf["model.embed_tokens.weight"], 0, vocab),
           "decoder.decoder_norm.scale": hf["model.norm.weight"]}
    if not cfg["logits_via_embedding"]:
        out["decoder.logits_dense.kernel"] = _pad(hf["lm_head.weight"].T, 1, vocab)
    if kind.removesuffix("_mxfp4") in GROUPED:
        return {**out, **grouped_layers(kind, hf, cfg)}
    layers = [layer(kind, hf, i, cfg) for i in range(cfg["num_decoder_layers"])]
    if not cfg["scan_layers"]:
        out.update({f"decoder.layers_{i}.{k}": v for i, leaves in enumerate(layers) for k, v in leaves.items()})
        return out
    for name in layers[0]:
        # param_scan_axis 1 makes an expert stack [E, ...] into [E, L, ...], 0 into [L, E, ...]: MaxText's tree
        out[f"decoder.layers.{name}"] = np.stack([leaves[name] for leaves in layers], axis=cfg["param_scan_axis"])
    return out
