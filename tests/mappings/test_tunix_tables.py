"""The tunix tables (``otfload.mappings.tunix_qwen3`` / ``tunix_gemma3``) without tunix: each is
loaded into a hand-built tree of ``jax.ShapeDtypeStruct`` with tunix 0.1.7's exact leaf paths,
shapes and sharding specs, from a tiny checkpoint written with safetensors, and every leaf is
compared with numpy's own rearrangement of the HF tensors. (tests/tunix checks the same tables
against tunix's loader and forward pass, in tunix's venv.)"""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import save_file

import otfload
from otfload.mappings import tunix_gemma3, tunix_qwen3

V, D, F, N, K, H, LAYERS, E, FE = 128, 64, 128, 8, 4, 16, 2, 4, 32


def write_checkpoint(path, tensors: dict, **config) -> dict:
    """``tensors`` split over two safetensors files with an index, and a config.json."""
    path.mkdir()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"hidden_size": D, "num_attention_heads": N, "head_dim": H,
                                                  "vocab_size": V, "num_hidden_layers": LAYERS, **config}))
    return tensors


def hf_tensors(path, kv_heads=K, *, qwen: bool, tied=False, experts=0) -> dict:
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    t = {"model.embed_tokens.weight": r(V, D), "model.norm.weight": r(D)}
    if not tied and qwen:
        t["lm_head.weight"] = r(V, D)
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        t |= {pre + "self_attn.q_proj.weight": r(N * H, D), pre + "self_attn.k_proj.weight": r(kv_heads * H, D),
              pre + "self_attn.v_proj.weight": r(kv_heads * H, D), pre + "self_attn.o_proj.weight": r(D, N * H),
              pre + "self_attn.q_norm.weight": r(H), pre + "self_attn.k_norm.weight": r(H),
              pre + "input_layernorm.weight": r(D), pre + "post_attention_layernorm.weight": r(D)}
        if not qwen:
            t |= {pre + "pre_feedforward_layernorm.weight": r(D), pre + "post_feedforward_layernorm.weight": r(D)}
        if experts:
            t[pre + "mlp.gate.weight"] = r(experts, D)
            for e in range(experts):
                t |= {pre + f"mlp.experts.{e}.gate_proj.weight": r(FE, D),
                      pre + f"mlp.experts.{e}.up_proj.weight": r(FE, D),
                      pre + f"mlp.experts.{e}.down_proj.weight": r(D, FE)}
        else:
            t |= {pre + "mlp.gate_proj.weight": r(F, D), pre + "mlp.up_proj.weight": r(F, D),
                  pre + "mlp.down_proj.weight": r(D, F)}
    return write_checkpoint(path, t, num_key_value_heads=kv_heads, tie_word_embeddings=tied)


def leaf(mesh, shape, *spec):
    return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, P(*spec)))


def qwen3_tree(mesh, tied=False, experts=0) -> dict:
    """tunix's Qwen3 leaves (tunix.models.qwen3.model, default ShardingConfig)."""
    tree = {"embedder.input_embedding": leaf(mesh, (V, D), "tp", "fsdp"), "final_norm.w": leaf(mesh, (D,), "tp")}
    if not tied:
        tree["lm_head.w"] = leaf(mesh, (D, V), "fsdp", "tp")
    for i in range(LAYERS):
        pre = f"layers.{i}."
        tree |= {pre + "input_layernorm.w": leaf(mesh, (D,), "tp"),
                 pre + "post_attention_layernorm.w": leaf(mesh, (D,), "tp"),
                 pre + "attn.q_proj.w": leaf(mesh, (D, N, H), "fsdp", "tp", None),
                 pre + "attn.k_proj.w": leaf(mesh, (D, K, H), "fsdp", "tp", None),
                 pre + "attn.v_proj.w": leaf(mesh, (D, K, H), "fsdp", "tp", None),
                 pre + "attn.o_proj.w": leaf(mesh, (N, H, D), "tp", None, "fsdp"),
                 pre + "attn.q_norm.w": leaf(mesh, (H,), "tp"), pre + "attn.k_norm.w": leaf(mesh, (H,), "tp")}
        if experts:
            tree |= {pre + "mlp.router.kernel": leaf(mesh, (D, experts)),
                     pre + "mlp.gate_proj": leaf(mesh, (experts, D, FE), "fsdp", None, "tp"),
                     pre + "mlp.up_proj": leaf(mesh, (experts, D, FE), "fsdp", None, "tp"),
                     pre + "mlp.down_proj": leaf(mesh, (experts, FE, D), "fsdp", "tp", None)}
        else:
            tree |= {pre + "mlp.gate_proj.kernel": leaf(mesh, (D, F), "fsdp", "tp"),
                     pre + "mlp.up_proj.kernel": leaf(mesh, (D, F), "fsdp", "tp"),
                     pre + "mlp.down_proj.kernel": leaf(mesh, (F, D), "tp", "fsdp")}
    return tree


def qwen3_expected(hf: dict, tree: dict) -> dict:
    """What tunix's loader makes of each HF tensor, in numpy."""

    def heads(x, n):  # HF [n * H, D] → [D, n, H]
        return x.T.reshape(D, n, H)

    want = {"embedder.input_embedding": hf["model.embed_tokens.weight"], "final_norm.w": hf["model.norm.weight"],
            "lm_head.w": hf.get("lm_head.weight", hf["model.embed_tokens.weight"]).T}
    for i in range(LAYERS):
        pre, src = f"layers.{i}.", f"model.layers.{i}."
        want |= {pre + "input_layernorm.w": hf[src + "input_layernorm.weight"],
                 pre + "post_attention_layernorm.w": hf[src + "post_attention_layernorm.weight"],
                 pre + "attn.q_proj.w": heads(hf[src + "self_attn.q_proj.weight"], N),
                 pre + "attn.k_proj.w": heads(hf[src + "self_attn.k_proj.weight"], K),
                 pre + "attn.v_proj.w": heads(hf[src + "self_attn.v_proj.weight"], K),
                 pre + "attn.o_proj.w": hf[src + "self_attn.o_proj.weight"].T.reshape(N, H, D),
                 pre + "attn.q_norm.w": hf[src + "self_attn.q_norm.weight"],
                 pre + "attn.k_norm.w": hf[src + "self_attn.k_norm.weight"]}
        if src + "mlp.gate.weight" in hf:
            experts = hf[src + "mlp.gate.weight"].shape[0]
            want[pre + "mlp.router.kernel"] = hf[src + "mlp.gate.weight"].T
            for name in ("gate_proj", "up_proj", "down_proj"):
                want[pre + f"mlp.{name}"] = np.stack([hf[src + f"mlp.experts.{e}.{name}.weight"].T
                                                      for e in range(experts)])
        else:
            for name in ("gate_proj", "up_proj", "down_proj"):
                want[pre + f"mlp.{name}.kernel"] = hf[src + f"mlp.{name}.weight"].T
    return {k: v for k, v in want.items() if k in tree}


def assert_loaded(loaded: dict, tree: dict, want: dict) -> None:
    assert loaded.keys() == tree.keys() == want.keys()
    for name, array in loaded.items():
        assert array.sharding == tree[name].sharding, name
        assert array.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(array), want[name], err_msg=name)


@pytest.mark.parametrize("kind", ["dense", "tied", "untied_model_tied_checkpoint", "moe"])
def test_tunix_qwen3_table(tmp_path, mesh_2x4, kind):
    experts = E if kind == "moe" else 0
    hf = hf_tensors(tmp_path / "ckpt", qwen=True, tied=kind != "dense" and kind != "moe", experts=experts)
    tree = qwen3_tree(mesh_2x4, tied=kind == "tied", experts=experts)
    plan = otfload.plan_params(tmp_path / "ckpt", tree, tunix_qwen3.TABLE)
    if kind == "moe":
        gate = plan.leaves["layers.1.mlp.gate_proj"].describe()
        assert gate["stack_axes"] == ["expert"] and gate["num_hf_keys"] == E
    if kind == "untied_model_tied_checkpoint":  # lm_head.w from the embedding, as transformers ties it
        assert plan.leaves["lm_head.w"].describe()["hf_keys"] == ["model.embed_tokens.weight"]
    loaded = otfload.load_params(tmp_path / "ckpt", tree, tunix_qwen3.TABLE, strict=True)
    assert_loaded(loaded, tree, qwen3_expected(hf, tree))


def gemma3_tree(mesh, kv_heads: int) -> dict:
    """tunix's Gemma3 leaves (tunix.models.gemma3.model, default ShardingConfig), with kv_einsum, or
    qkv_einsum when every head has its own k/v. The 1-D q/k norms say ``out_sharding=()``: replicated."""
    tree = {"embedder.input_embedding": leaf(mesh, (V, D), "tp", "fsdp"), "final_norm.scale": leaf(mesh, (D,), "tp")}
    for i in range(LAYERS):
        pre = f"layers.{i}."
        tree |= {pre + f"{norm}.scale": leaf(mesh, (D,), "tp")
                 for norm in ("pre_attention_norm", "post_attention_norm", "pre_ffw_norm", "post_ffw_norm")}
        tree |= {pre + "attn.attn_vec_einsum.w": leaf(mesh, (N, H, D), "tp", None, "fsdp"),
                 pre + "attn._query_norm.scale": leaf(mesh, (H,)), pre + "attn._key_norm.scale": leaf(mesh, (H,)),
                 pre + "mlp.gate_proj.kernel": leaf(mesh, (D, F), "fsdp", "tp"),
                 pre + "mlp.up_proj.kernel": leaf(mesh, (D, F), "fsdp", "tp"),
                 pre + "mlp.down_proj.kernel": leaf(mesh, (F, D), "tp", "fsdp")}
        if kv_heads == N:
            tree[pre + "attn.qkv_einsum.w"] = leaf(mesh, (3, N, D, H), None, "tp", "fsdp", None)
        else:
            tree[pre + "attn.q_einsum.w"] = leaf(mesh, (N, D, H), "tp", "fsdp", None)
            tree[pre + "attn.kv_einsum.w"] = leaf(mesh, (2, kv_heads, D, H), None, "tp", "fsdp", None)
    return tree


def gemma3_expected(hf: dict, kv_heads: int) -> dict:
    """What tunix's loader makes of each HF tensor, in numpy: the fused k/v (q/k/v) weights are the
    head-split parts stacked on a leading axis."""

    def heads(x, n):  # HF [n * H, D] → tunix [n, D, H]
        return x.T.reshape(D, n, H).transpose(1, 0, 2)

    want = {"embedder.input_embedding": hf["model.embed_tokens.weight"], "final_norm.scale": hf["model.norm.weight"]}
    for i in range(LAYERS):
        pre, src = f"layers.{i}.", f"model.layers.{i}."
        norms = {"pre_attention_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                 "pre_ffw_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
        want |= {pre + f"{ours}.scale": hf[src + f"{theirs}.weight"] for ours, theirs in norms.items()}
        q, k, v = (heads(hf[src + f"self_attn.{p}_proj.weight"], n) for p, n in (("q", N), ("k", kv_heads),
                                                                               ("v", kv_heads)))
        want |= {pre + "attn.attn_vec_einsum.w": hf[src + "self_attn.o_proj.weight"].T.reshape(N, H, D),
                 pre + "attn._query_norm.scale": hf[src + "self_attn.q_norm.weight"],
                 pre + "attn._key_norm.scale": hf[src + "self_attn.k_norm.weight"]}
        want |= {pre + f"mlp.{p}.kernel": hf[src + f"mlp.{p}.weight"].T for p in ("gate_proj", "up_proj", "down_proj")}
        if kv_heads == N:
            want[pre + "attn.qkv_einsum.w"] = np.stack([q, k, v])
        else:
            want[pre + "attn.q_einsum.w"] = q
            want[pre + "attn.kv_einsum.w"] = np.stack([k, v])
    return want


@pytest.mark.parametrize("kv_heads", [K, N], ids=["kv_einsum", "qkv_einsum"])
def test_tunix_gemma3_table(tmp_path, mesh_2x4, kv_heads):
    hf = hf_tensors(tmp_path / "ckpt", kv_heads, qwen=False)
    tree = gemma3_tree(mesh_2x4, kv_heads)
    plan = otfload.plan_params(tmp_path / "ckpt", tree, tunix_gemma3.TABLE)
    fused, parts = ("qkv_einsum", "qkv") if kv_heads == N else ("kv_einsum", "kv")
    assert [info.name for info in plan.leaves[f"layers.1.attn.{fused}.w"].sources] == [
        f"model.layers.1.self_attn.{p}_proj.weight" for p in parts]
    loaded = otfload.load_params(tmp_path / "ckpt", tree, tunix_gemma3.TABLE, strict=True)
    assert_loaded(loaded, tree, gemma3_expected(hf, kv_heads))
