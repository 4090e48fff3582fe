"""DeepSeek-V4 (``deepseek_v4``): a tiny transformers checkpoint → otfload → f32 logits equal
transformers', scanned and not, on 8 simulated devices (experts on ``ep`` and heads on ``tp``), padded
rows included; the rules behind them are live; gradients equal autograd's; the RoPEs equal
transformers' buffers; the export round trip; configs (transformers' defaults, the published
V4-Flash) parse as transformers reads them, and what otfload does not implement is a typed error
naming its field; V4-Flash plans at full size on 256 devices.

The tiny model has every layer kind: sliding, CSA (rate 4) and HCA (rate 8) attention; one hash-routed
and three top-k MoE layers (a random ``tid2eid`` table of distinct experts and a random correction
bias: transformers initialises both to zeros); two hyper-connection streams; YaRN on the compressed
RoPE. 5 tokens leave HCA no window and CSA one (below ``index_topk = 2``); 20 tokens give a sliding
window of 8 tokens to slide, HCA two windows and CSA five, of which the later queries see the indexer's
top 2; queries attended 8 at a time (``q_chunk``) make them three chunks, each reading only its
sliding slots. 16 indexer heads make an exact tie of two windows' scores too rare to meet.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.errors import ConfigError
from otfload.export import export_hf
from otfload.families.deepseek_v4.config import CSA, HCA, SLIDING, deepseek_v4_config
from otfload.families.deepseek_v4.model import rotary
from otfload.models.attention import make_context
from otfload.models.compressed_attention import compressed_attention_forward
from otfload.models.hash_moe import TRAINABLE
from otfload.models.layers import pure
from otfload.plan.sharding import make_mesh
from tests.export.test_export import assert_bit_exact, read_tensors, weight_map_keys
from tests.families.checks import MESHES
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.training.test_gradients import (
    PAD,
    batch,
    exported_grads,
    next_token_loss,
    torch_loss_and_grads,
    with_pad_id,
)

TINY = {
    "vocab_size": 256, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "head_dim": 32, "q_lora_rank": 32, "qk_rope_head_dim": 8, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "o_groups": 2, "o_lora_rank": 16, "index_n_heads": 16, "index_head_dim": 16,
    "index_topk": 2, "sliding_window": 8, "layer_types": [SLIDING, CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 8}, "num_hash_layers": 1, "hc_mult": 2, "hc_sinkhorn_iters": 3,
    "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 256,
}  # fmt: skip
REAL = Path(__file__).resolve().parents[3] / "shared" / "realconfigs" / "deepseek-ai__DeepSeek-V4-Flash.json"
NEEDS_REAL = pytest.mark.skipif(not REAL.is_file(), reason="../shared/realconfigs is not checked out")


def _tiny(**kw):
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(DeepseekV4Config(**{**TINY, **kw}))
    gen = torch.Generator().manual_seed(1)
    experts, k = TINY["n_routed_experts"], TINY["num_experts_per_tok"]
    with torch.no_grad():  # buffers: tests.helpers.randomize_ randomises parameters only
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(experts, generator=gen)[:k] for _ in range(buf.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)
    return model


register_hf_model("deepseek_v4", _tiny)


def _forward(model, ids: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """Jitted logits; with a padding ``mask``, at transformers' V4 positions: the slot indices (its
    forward takes ``arange`` whatever the mask, and its compressors pool windows from slot 0, pads
    included), not otfload's default (each real token's index among its row's)."""
    if mask is None:
        return logits(model, ids)
    slots = jnp.arange(ids.shape[1])[None]
    return np.asarray(jax.jit(lambda m, x, k: m(x, attention_mask=k, positions=slots))(model, ids, mask))


@pytest.mark.parametrize(("scan_layers", "mesh_name", "padded"), [(True, "fsdp2_ep4", False),
                                                                   (False, "fsdp2_tp4", True)])
def test_f32_logits_match_transformers(tiny_checkpoints, scan_layers, mesh_name, padded):
    """20 tokens; scanned, in query chunks of 8 (three, each reading the 15 sliding slots it can
    see); unscanned, one row right-padded and one left-padded (13 real tokens each), whose real
    tokens' logits equal transformers' under the same mask."""
    import torch

    path, torch_model = tiny_checkpoints("deepseek_v4")
    assert len(list(path.glob("*.safetensors"))) > 1
    mesh = make_mesh(MESHES[mesh_name])
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers)
    csa = model.csa_moe_layers if scan_layers else model.csa_moe_layers[1]
    assert csa.attn.indexer.q_b.kernel[...].shape == ((2,) if scan_layers else ()) + (16, 16, 32)
    spec = csa.moe.experts.gate.kernel[...].sharding.spec
    assert spec[1 if scan_layers else 0] == ("ep" if "ep" in MESHES[mesh_name] else None)
    ids, mask = token_ids(seq=20), np.ones((2, 20), np.int64)
    if padded:
        mask[0, 13:], mask[1, :7] = 0, 0
    else:
        model.q_chunk = 8
        assert 2 * model.q_chunk - 1 < 20 and model.q_chunk == TINY["sliding_window"]
    with torch.no_grad():
        ref = torch_model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    with jax.set_mesh(mesh):
        ours = _forward(model, ids, mask if padded else None)
    real = mask.astype(bool)
    assert max_rel_diff(ours[real], ref[real]) <= 1e-4


def test_the_window_and_top_k_rules_are_live(tiny_checkpoints, mesh_2x4):
    """5 tokens (no HCA window, one CSA window: fewer than index_topk) match transformers; at 20 (the
    logits test's length), a CSA layer attending to every window instead of the indexer's top 2, or to
    every earlier token instead of the sliding window's 8, moves its output well past the bound."""
    path, torch_model = tiny_checkpoints("deepseek_v4")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=5)
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4
    layer = jax.tree.map(lambda a: np.asarray(a)[0], pure(model.csa_moe_layers.attn))  # layer 1, on the host
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 20, TINY["hidden_size"])), jnp.float32)
    ctx = make_context(jnp.zeros((2, 20), jnp.int32), None, None, None)

    def attention(cfg) -> np.ndarray:
        return np.asarray(jax.jit(lambda p, h: compressed_attention_forward(p, h, CSA, cfg, model._ropes(), ctx)[0])(
            layer, x))

    base = attention(model.cfg)
    for change in ({"index_topk": 64}, {"sliding_window": 64}):
        assert max_rel_diff(attention(dataclasses.replace(model.cfg, **change)), base) > 1e-3, change


def test_the_ropes_equal_transformers_buffers(tiny_checkpoints):
    _, torch_model = tiny_checkpoints("deepseek_v4")
    cfg = deepseek_v4_config(torch_model.config.to_dict())
    rope = torch_model.model.rotary_emb
    for name, spec in (("main", cfg.main_rope), ("compress", cfg.compress_rope)):
        ours = rotary(cfg, spec)
        np.testing.assert_allclose(ours.inv_freq, getattr(rope, f"{name}_inv_freq").numpy(), rtol=1e-6)
        assert ours.scale == getattr(rope, f"{name}_attention_scaling")


def test_export_round_trip_is_bit_exact_but_the_hash_table_is_int32(tiny_checkpoints, mesh_2x4, tmp_path):
    """Every tensor written back bit-exact under its key, in file order, except ``tid2eid``: its leaf
    is int32 (JAX's integers without x64), so the table comes back with the same values as int32."""
    src, _ = tiny_checkpoints("deepseek_v4")
    written = export_hf(otfload.from_pretrained(src, mesh=mesh_2x4), tmp_path / "out", reference=src,
                        max_shard_size="60KB")
    ours, ref = read_tensors(written), read_tensors(src)
    table = "model.layers.0.ffn.gate.tid2eid"
    assert ours[table].dtype == np.int32 and ref[table].dtype == np.int64
    np.testing.assert_array_equal(ours.pop(table), ref.pop(table))
    assert_bit_exact(ours, ref)
    assert weight_map_keys(written) == weight_map_keys(src)


def _torch_grads(path: Path, ids: np.ndarray, dtype, out: Path) -> tuple[float, dict[str, np.ndarray]]:
    """transformers' loss and gradients in ``dtype`` (its eager experts: grouped_mm has no float64)."""
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(path, experts_implementation="eager").to(dtype).eval()
    return torch_loss_and_grads(model, ids, PAD, out)


CANCELLED = 1e-4  # a tensor's gradient this far below the largest entry is a sum that cancels


def _norm(tensors: dict[str, np.ndarray]) -> float:
    return float(np.sqrt(sum(np.square(t, dtype=np.float64).sum() for t in tensors.values())))


def test_gradients_equal_torch_autograd(tiny_checkpoints, tmp_path):
    """One jitted gradient of the next-token loss (``wrt=TRAINABLE``: every parameter but the int32
    ``tid2eid``) equals transformers' float64 autograd: the whole gradient's norm within 1e-4, each
    tensor within 1e-4 of its largest entry, or within twice transformers' own float32 error where
    that is larger. Tensors whose gradient is below :data:`CANCELLED` of the gradient's largest entry
    (the hyper-connection head's scale, base and weights: the final RMSNorm undoes a scale of its
    input, so their gradients are sums that cancel to ~1e-6 of the rest) are at float32 rounding of
    what they sum: within 1e-3 there (measured 1.5e-4; float32 torch 1e-5 to 4e-4, by thread count).
    The loss within 1e-5; the indexer's parameters and the correction bias get none on either side."""
    import torch

    src, _ = tiny_checkpoints("deepseek_v4")
    path = with_pad_id(src, tmp_path / "ckpt")
    mesh = make_mesh(MESHES["fsdp2_ep4"])
    model = otfload.from_pretrained(path, mesh=mesh)
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = nnx.jit(nnx.value_and_grad(next_token_loss, argnums=nnx.DiffState(0, TRAINABLE)))(
            model, jnp.asarray(ids))
    ours = exported_grads(grads, path, tmp_path / "grads")
    ref_loss, ref = _torch_grads(path, ids, torch.float64, tmp_path / "f64")
    _, f32 = _torch_grads(path, ids, torch.float32, tmp_path / "f32")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert set(ref) - set(ours) == {"model.layers.0.ffn.gate.tid2eid"}
    largest = max(float(np.abs(grad).max()) for grad in ref.values())
    assert _norm({k: ours[k] - ref[k] for k in ours}) <= 1e-4 * _norm(ref)
    for key, grad in ours.items():
        if "indexer" in key or key.endswith("gate.bias"):  # they only pick windows / experts
            assert not np.any(ref[key]), key
        if not np.any(ref[key]):  # those, and experts no token of the batch reached
            assert not np.any(grad), key
            continue
        cancelled = np.abs(ref[key]).max() < CANCELLED * largest
        bound = max(1e-3 if cancelled else 1e-4, 2 * max_rel_diff(f32[key], ref[key]))
        assert max_rel_diff(grad, ref[key]) <= bound, (key, max_rel_diff(grad, ref[key]), bound)


# --- configs ------------------------------------------------------------------------------------


def _transformers_config(**kw):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(**kw)


def _assert_read_as_transformers(cfg, ref) -> None:
    assert cfg.layer_types == tuple(ref.layer_types)
    assert cfg.mlp_layer_types == tuple(ref.mlp_layer_types)
    assert cfg.compress_rates == ref.compress_rates
    assert cfg.qk_rope_head_dim == ref.qk_rope_head_dim
    for name in ("main", "compress"):
        assert getattr(cfg, f"{name}_rope").theta == ref.rope_parameters[name]["rope_theta"]
    fields = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups",
              "o_lora_rank", "index_n_heads", "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters",
              "sliding_window", "swiglu_limit", "routed_scaling_factor", "num_experts_per_tok", "scoring_func")
    assert {f: getattr(cfg, f) for f in fields} == {f: getattr(ref, f) for f in fields}
    assert cfg.num_experts == ref.n_routed_experts


def test_transformers_default_config_parses_as_transformers_reads_it():
    ref = _transformers_config()
    cfg = deepseek_v4_config(ref.to_dict())
    _assert_read_as_transformers(cfg, ref)
    assert cfg.layer_types[:3] == (HCA, HCA, HCA) and cfg.mlp_layer_types.count("hash_moe") == 3
    assert deepseek_v4_config({"model_type": "deepseek_v4"}) == dataclasses.replace(cfg, pad_token_id=None)


@NEEDS_REAL
def test_the_published_config_parses_as_transformers_reads_it():
    """FP4 experts included (their layout: tests/families/test_deepseek_v4_quantized.py)."""
    real = json.loads(REAL.read_text())
    cfg = deepseek_v4_config(real)
    _assert_read_as_transformers(cfg, _transformers_config(**real))
    # 44 compress_ratios for 43 layers (the last is the MTP layer's): 0, 0, then CSA / HCA alternating
    assert cfg.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and cfg.layer_types[-1] == CSA
    assert cfg.compress_rope.scaling is not None and cfg.compress_rope.scaling["attention_factor"] == 1.0
    assert cfg.main_rope.scaling is None and cfg.mtp_layers == 1


@pytest.mark.parametrize(("change", "field"), [
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"n_shared_experts": 2}, "n_shared_experts"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"topk_method": "greedy"}, "topk_method"),
    ({"expert_dtype": "int4"}, "expert_dtype"),
    ({"quantization_config": {"quant_method": "fp8", "expert_dtype": "int4"}}, "quantization_config.expert_dtype"),
    ({"layer_types": [SLIDING, "full_attention", HCA, CSA]}, "layer_types[1]"),
    ({"layer_types": [SLIDING, CSA]}, "layer_types"),
    ({"layer_types": None, "compress_ratios": [0, 4, 16, 4]}, "compress_ratios[2]"),
    ({"mlp_layer_types": ["hash_moe", "dense", "moe", "moe"]}, "mlp_layer_types[1]"),
    ({"compress_rates": {CSA: 4, "sliding_attention": 8}}, "compress_rates.sliding_attention"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.type"),
    ({"o_groups": 3}, "o_groups"),
    ({"qk_rope_head_dim": 7}, "partial_rotary_factor"),
])  # fmt: skip
def test_unsupported_configs_are_typed_errors_naming_the_field(change, field):
    hf = {**TINY, "model_type": "deepseek_v4"}
    deepseek_v4_config(hf)  # the unchanged config parses
    with pytest.raises(ConfigError) as err:
        deepseek_v4_config({**hf, **change})
    assert err.value.field == field and field in str(err.value)


@pytest.mark.parametrize(("change", "field"), [
    ({"num_hidden_layers": 3, "layer_types": TINY["layer_types"][:3]}, "num_hidden_layers"),
    ({"n_routed_experts": 4}, "n_routed_experts"),
    ({"vocab_size": 300}, "vocab_size"),
    ({"num_attention_heads": 2, "o_groups": 1}, "num_attention_heads"),
])  # fmt: skip
def test_a_config_the_tensors_contradict_is_a_typed_error(tiny_checkpoints, tmp_path, change, field):
    src, _ = tiny_checkpoints("deepseek_v4")
    path = shutil.copytree(src, tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError) as err:
        otfload.plan_model(path)
    assert err.value.field == field


# --- real size ----------------------------------------------------------------------------------


def _full_size_headers(path: Path) -> Path:
    """A header-only V4-Flash (the published config, its experts declared bf16 and no
    ``quantization_config``; the published FP4 layout: test_deepseek_v4_quantized.py) under the release's
    tensor names (no ``model.`` prefix; otfload reads them as its fallbacks): BF16 weights, float32
    hyper-connections, sinks, ``ape`` and router bias, int32 ``tid2eid``; one file per layer and an
    MTP tensor (never read)."""
    from tests.realsize import write_header_checkpoint

    config = {k: v for k, v in json.loads(REAL.read_text()).items() if k != "quantization_config"}
    config["expert_dtype"] = "bf16"
    cfg = deepseek_v4_config(config)
    h, n, d, r, m, e = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank,
                        cfg.moe_intermediate_size, cfg.num_experts)
    bf16, f32 = (lambda *shape: ("BF16", shape)), (lambda *shape: ("F32", shape))  # noqa: E731
    hc = (2 + cfg.hc_mult) * cfg.hc_mult

    def swiglu(key: str) -> dict:
        return {key.format("w1"): bf16(m, h), key.format("w3"): bf16(m, h), key.format("w2"): bf16(h, m)}

    def compressor(key: str, dim: int, rate: int, series: int) -> dict:
        return {f"{key}.wkv.weight": bf16(series * dim, h), f"{key}.wgate.weight": bf16(series * dim, h),
                f"{key}.ape": f32(rate, series * dim), f"{key}.norm.weight": bf16(dim)}

    shards = {}
    for i, (kind, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types, strict=True)):
        p, a = f"layers.{i}", f"layers.{i}.attn"
        t = {f"{p}.attn_norm.weight": bf16(h), f"{p}.ffn_norm.weight": bf16(h)}
        for x in ("attn", "ffn"):
            t |= {f"{p}.hc_{x}_fn": f32(hc, cfg.hc_mult * h), f"{p}.hc_{x}_base": f32(hc), f"{p}.hc_{x}_scale": f32(3)}
        t |= {f"{a}.wq_a.weight": bf16(r, h), f"{a}.q_norm.weight": bf16(r), f"{a}.wq_b.weight": bf16(n * d, r),
              f"{a}.wkv.weight": bf16(d, h), f"{a}.kv_norm.weight": bf16(d), f"{a}.attn_sink": f32(n),
              f"{a}.wo_a.weight": bf16(cfg.o_groups * cfg.o_lora_rank, n * d // cfg.o_groups),
              f"{a}.wo_b.weight": bf16(h, cfg.o_groups * cfg.o_lora_rank)}
        if kind != SLIDING:
            rate = cfg.compress_rates[kind]
            t |= compressor(f"{a}.compressor", d, rate, 2 if kind == CSA else 1)
        if kind == CSA:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            t |= compressor(f"{a}.indexer.compressor", idim, rate, 2)
            t |= {f"{a}.indexer.wq_b.weight": bf16(ih * idim, r), f"{a}.indexer.weights_proj.weight": bf16(ih, h)}
        f = f"{p}.ffn"
        t |= {f"{f}.gate.weight": bf16(e, h), **swiglu(f"{f}.shared_experts.{{}}.weight")}
        t |= {f"{f}.gate.tid2eid": ("I32", (cfg.vocab_size, cfg.num_experts_per_tok))} if mlp == "hash_moe" else {
            f"{f}.gate.bias": f32(e)}
        for x in range(e):
            t |= swiglu(f"{f}.experts.{x}.{{}}.weight")
        shards[f"model-{i + 1:05d}-of-{cfg.num_hidden_layers + 1:05d}.safetensors"] = t
    shards["model-last.safetensors"] = {
        "embed.weight": bf16(cfg.vocab_size, h), "head.weight": bf16(cfg.vocab_size, h), "norm.weight": bf16(h),
        "hc_head_fn": f32(cfg.hc_mult, cfg.hc_mult * h), "hc_head_base": f32(cfg.hc_mult), "hc_head_scale": f32(1),
        "mtp.0.emb.tok_emb.weight": bf16(cfg.vocab_size, h)}
    return write_header_checkpoint(path, shards, config)


@NEEDS_REAL
def test_full_size_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` of V4-Flash at full size (fsdp=32, ep=8): every leaf planned
    from the release's names, experts on ``ep``, within 10 s of CPU and 1 GiB, and one process's bytes
    within 1.1 x its devices' share of the checkpoint."""
    from tests.realsize import inspect_at_scale

    cpu, peak, info = inspect_at_scale(_full_size_headers(tmp_path / "deepseek_v4"), "fsdp=32,ep=8")
    print(f"plan: {cpu:.2f} s CPU, peak {peak / 2**20:.0f} MiB")
    assert cpu <= 10 and peak <= 2**30, (cpu, peak)
    assert info["model_type"] == "deepseek_v4" and info["unused"] == []
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    experts = leaves["csa_moe_layers.moe.experts.gate.kernel"]
    assert experts["shape"] == [20, 256, 2048, 4096] and "'ep'" in experts["sharding"], experts
    assert leaves["sliding_hash_layers.moe.router.tid2eid"]["shape"] == [2, 129280, 6]  # layers 0, 1
    assert leaves["csa_hash_layers.moe.router.tid2eid"]["shape"] == [1, 129280, 6]  # layer 2
    assert leaves["csa_moe_layers.attn.indexer.q_b.kernel"]["shape"] == [20, 64, 128, 1024]
    totals = info["totals"]
    assert 550e9 < totals["source_bytes"] < 600e9, totals
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)
