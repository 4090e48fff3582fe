"""numpy references of the MaxText trees whose layers come in groups — DeepSeek (``dense_layers``,
then ``moe_layers``; V3.2's indexer in each layer's ``self_attention``) and GPT-OSS (scanned as
``layers.layers_0`` / ``layers_1``, every other HF layer) — written from MaxText's converter
(``param_mapping.DEEPSEEK_*`` / ``GPT_OSS_*``): kernels ``[in, out]`` with heads split, nothing else
changed; GPT-OSS's fused ``gate_up_proj`` split into its even (gate, ``wi_0``) and odd (up, ``wi_1``)
columns. Scanned leaves stack at ``param_scan_axis``, but DeepSeek-V3's routing bias (a
``MoEBiasVar``, which MaxText scans at 0). DeepSeek-V3's multi-token-prediction layer
(``mtp_num_layers: 1``; HF layer ``num_hidden_layers``, which transformers neither builds nor saves:
:func:`add_mtp_layer` writes random tensors for it) is ``mtp_block.mtp_layer_1``, unstacked, as
MaxText's model code names its modules."""

from __future__ import annotations

import numpy as np

ROUTING_BIAS = "DeepSeekMoeBlock_0.MoeBlock_0.gate.bias"


def kernel(w: np.ndarray, *split: int) -> np.ndarray:
    """An HF ``[out, in]`` weight as MaxText's ``[in, out]`` kernel, reshaped to ``split``."""
    return w.T.reshape(*split) if split else w.T


def _mla(hf: dict[str, np.ndarray], i: int, cfg: dict) -> dict[str, np.ndarray]:
    a, h, heads = f"model.layers.{i}.self_attn", cfg["emb_dim"], cfg["num_query_heads"]
    qk, nope_v = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"] + cfg["v_head_dim"]
    out = {"pre_self_attention_layer_norm.scale": hf[f"model.layers.{i}.input_layernorm.weight"],
           "post_self_attention_layer_norm.scale": hf[f"model.layers.{i}.post_attention_layernorm.weight"],
           "self_attention.wkv_a.kernel": hf[f"{a}.kv_a_proj_with_mqa.weight"].T,
           "self_attention.kv_norm.scale": hf[f"{a}.kv_a_layernorm.weight"],
           "self_attention.wkv_b.kernel": kernel(hf[f"{a}.kv_b_proj.weight"], cfg["kv_lora_rank"], heads, nope_v),
           "self_attention.out.kernel": kernel(hf[f"{a}.o_proj.weight"], heads, cfg["v_head_dim"], h)}
    if cfg.get("q_lora_rank"):
        out["self_attention.wq_a.kernel"] = hf[f"{a}.q_a_proj.weight"].T
        out["self_attention.q_norm.scale"] = hf[f"{a}.q_a_layernorm.weight"]
        out["self_attention.wq_b.kernel"] = kernel(hf[f"{a}.q_b_proj.weight"], cfg["q_lora_rank"], heads, qk)
    else:
        out["self_attention.query.kernel"] = kernel(hf[f"{a}.q_proj.weight"], h, heads, qk)
    if f"{a}.indexer.wk.weight" in hf:  # V3.2's lightning indexer
        out.update(_indexer(hf, f"{a}.indexer", cfg))
    return out


def _indexer(hf: dict[str, np.ndarray], x: str, cfg: dict) -> dict[str, np.ndarray]:
    heads, dim = cfg["indexer_n_heads"], cfg["indexer_head_dim"]
    return {"self_attention.indexer.wq_b.kernel": kernel(hf[f"{x}.wq_b.weight"], cfg["q_lora_rank"], heads, dim),
            "self_attention.indexer.wk.kernel": hf[f"{x}.wk.weight"].T,
            "self_attention.indexer.k_norm.scale": hf[f"{x}.k_norm.weight"],
            "self_attention.indexer.k_norm.bias": hf[f"{x}.k_norm.bias"],
            "self_attention.indexer.weights_proj.kernel": hf[f"{x}.weights_proj.weight"].T}


def _mlp(hf: dict[str, np.ndarray], module: str, source: str) -> dict[str, np.ndarray]:
    return {f"{module}.{leaf}.kernel": hf[f"{source}.{name}.weight"].T
            for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj"))}


def _dense(hf: dict[str, np.ndarray], i: int, cfg: dict) -> dict[str, np.ndarray]:
    return {**_mla(hf, i, cfg), **_mlp(hf, "mlp", f"model.layers.{i}.mlp")}


def _moe(hf: dict[str, np.ndarray], i: int, cfg: dict) -> dict[str, np.ndarray]:
    m, block = f"model.layers.{i}.mlp", "DeepSeekMoeBlock_0"
    out = {**_mla(hf, i, cfg), **_mlp(hf, f"{block}.shared_experts", f"{m}.shared_experts"),
           f"{block}.MoeBlock_0.gate.kernel": hf[f"{m}.gate.weight"].T}
    if f"{m}.gate.e_score_correction_bias" in hf:
        out[ROUTING_BIAS] = hf[f"{m}.gate.e_score_correction_bias"]
    for leaf, name in (("wi_0", "gate_proj"), ("wi_1", "up_proj"), ("wo", "down_proj")):
        out[f"{block}.MoeBlock_0.{leaf}"] = np.stack([hf[f"{m}.experts.{e}.{name}.weight"].T
                                                     for e in range(cfg["num_experts"])])
    return out


def _gpt_oss(hf: dict[str, np.ndarray], i: int, cfg: dict) -> dict[str, np.ndarray]:
    a, x, h, hd = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp.experts", cfg["emb_dim"], cfg["head_dim"]
    out = {"pre_self_attention_layer_norm.scale": hf[f"model.layers.{i}.input_layernorm.weight"],
           "post_self_attention_layer_norm.scale": hf[f"model.layers.{i}.post_attention_layernorm.weight"],
           "GptOssAttention.out.kernel": kernel(hf[f"{a}.o_proj.weight"], cfg["num_query_heads"], hd, h),
           "GptOssAttention.out.bias": hf[f"{a}.o_proj.bias"],
           "GptOssAttention.sinks": hf[f"{a}.sinks"],
           "GptOssMlp.gate.kernel": hf[f"model.layers.{i}.mlp.router.weight"].T,
           "GptOssMlp.gate.bias": hf[f"model.layers.{i}.mlp.router.bias"],
           "GptOssMlp.wi_0": hf[f"{x}.gate_up_proj"][..., ::2], "GptOssMlp.wi_1": hf[f"{x}.gate_up_proj"][..., 1::2],
           "GptOssMlp.wi_0_bias": hf[f"{x}.gate_up_proj_bias"][..., ::2],
           "GptOssMlp.wi_1_bias": hf[f"{x}.gate_up_proj_bias"][..., 1::2],
           "GptOssMlp.wo": hf[f"{x}.down_proj"], "GptOssMlp.wo_bias": hf[f"{x}.down_proj_bias"]}
    for name, proj, heads in (("query", "q_proj", "num_query_heads"), ("key", "k_proj", "num_kv_heads"),
                              ("value", "v_proj", "num_kv_heads")):
        out[f"GptOssAttention.{name}.kernel"] = kernel(hf[f"{a}.{proj}.weight"], h, cfg[heads], hd)
        out[f"GptOssAttention.{name}.bias"] = hf[f"{a}.{proj}.bias"].reshape(cfg[heads], hd)
    return out


MTP = "mtp_block.mtp_layer_1.mtp_1"


def add_mtp_layer(path, layers: int) -> None:
    """Add DeepSeek-V3's multi-token-prediction layer (HF layer ``layers``, as the Hub's V3 has it:
    ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head``, its own ``embed_tokens`` and a MoE layer shaped as
    layer ``layers - 1``) to the checkpoint at ``path``, random values."""
    from safetensors.numpy import load_file

    from tests.helpers import rename_tensors

    rng = np.random.default_rng(3)
    tensors = {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}
    last, new = f"model.layers.{layers - 1}.", f"model.layers.{layers}."
    like = {new + k[len(last):]: v for k, v in tensors.items() if k.startswith(last)}
    embed = tensors["model.embed_tokens.weight"]
    hidden = embed.shape[1]
    like.update({f"{new}enorm.weight": embed[0], f"{new}hnorm.weight": embed[0],
                 f"{new}eh_proj.weight": np.zeros((hidden, 2 * hidden), embed.dtype),
                 f"{new}shared_head.norm.weight": embed[0], f"{new}shared_head.head.weight": embed,
                 f"{new}embed_tokens.weight": embed})
    extra = {k: (rng.standard_normal(v.shape) * 0.1).astype(v.dtype) for k, v in like.items()}
    rename_tensors(path, lambda key: key, extra)


def mtp_leaves(hf: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """The multi-token-prediction layer's MaxText leaves (``mtp_num_layers: 1``)."""
    i = cfg["num_decoder_layers"]
    out = {f"{MTP}_embedding_norm.scale": hf[f"model.layers.{i}.enorm.weight"],
           f"{MTP}_hidden_state_norm.scale": hf[f"model.layers.{i}.hnorm.weight"],
           f"{MTP}_projection.kernel": hf[f"model.layers.{i}.eh_proj.weight"].T,
           f"{MTP}_final_norm.scale": hf[f"model.layers.{i}.shared_head.norm.weight"]}
    return {**out, **{f"{MTP}_transformer_layer.{k}": v for k, v in _moe(hf, i, cfg).items()}}


def _groups(kind: str, cfg: dict) -> list[tuple[str, str, object, list[int]]]:
    """(scanned prefix, unscanned prefix, per-layer builder, HF layers) of each group."""
    layers = cfg["num_decoder_layers"]
    if kind.startswith("mt_deepseek"):
        dense = cfg["first_num_dense_layers"]
        return [("decoder.dense_layers", "decoder.dense_layers_", _dense, list(range(dense))),
                ("decoder.moe_layers", "decoder.moe_layers_", _moe, list(range(dense, layers)))]
    if not cfg["scan_layers"]:
        return [("", "decoder.layers_", _gpt_oss, list(range(layers)))]
    return [(f"decoder.layers.layers_{j}", "", _gpt_oss, list(range(j, layers, 2))) for j in range(2)]


def grouped_layers(kind: str, hf: dict[str, np.ndarray], cfg: dict) -> dict[str, np.ndarray]:
    """Every layer leaf (dotted path → array) of a grouped tree in the layout ``cfg`` names."""
    out: dict[str, np.ndarray] = mtp_leaves(hf, cfg) if cfg.get("mtp_num_layers") else {}
    for scanned, unscanned, build, hf_layers in _groups(kind, cfg):
        per_layer = [build(hf, i, cfg) for i in hf_layers]
        if not cfg["scan_layers"]:
            out.update({f"{unscanned}{n}.{k}": v for n, leaves in enumerate(per_layer) for k, v in leaves.items()})
            continue
        for name in per_layer[0]:
            axis = 0 if name == ROUTING_BIAS else cfg["param_scan_axis"]
            out[f"{scanned}.{name}"] = np.stack([leaves[name] for leaves in per_layer], axis=axis)
    return out
