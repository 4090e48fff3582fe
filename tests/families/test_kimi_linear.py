"""Kimi-Linear: tiny transformers checkpoints → otfload → logits and greedy ids equal transformers' (its
PyTorch reference kernels: chunk_kimi_delta_attention, the conv1d fallbacks; flash-linear-attention is
not installed), padded rows equal to the rows alone, the export round trip bit-exact, the per-channel
gated delta rule against the recurrence in numpy, and the config fields otfload does not implement
refused by name.

The tiny models mix KDA and MLA layers out of the default order, dense and MoE feed-forwards out of
the default order too (all four layer groups), with 5- to 70-token inputs (more than one 64-token
chunk); the second kind has a low-rank query (``q_lora_rank``) and its dense MLA layer first. The
full-size model (transformers' defaults: Kimi-Linear-48B-A3B's sizes) is planned at 256 devices.
"""

import json

import jax
import numpy as np
import pytest

import otfload
from otfload.errors import ConfigError
from otfload.export import export_hf
from otfload.families.kimi_linear.config import KimiLinearConfig
from otfload.models.gated_delta import gated_delta_rule, recurrent_gated_delta_rule
from otfload.plan.sharding import make_mesh
from tests.export.test_export import assert_bit_exact, read_tensors
from tests.families.checks import assert_greedy_matches, reference_logits
from tests.families.test_qwen3_5 import assert_padded_rows_alone
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, register_hf_model, token_ids, torch_logits

LIN, FULL = "linear_attention", "full_attention"
KIMI = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
            qk_nope_head_dim=16, v_head_dim=16, num_local_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
            linear_head_dim=8, linear_num_heads=4, layer_types=[LIN, LIN, FULL, LIN, FULL],
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "dense"], max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
Q_LORA = dict(num_hidden_layers=3, q_lora_rank=24, layer_types=[FULL, LIN, FULL], mlp_layer_types=None)


def _kimi_linear(**kw):
    from transformers import KimiLinearConfig as HFConfig
    from transformers import KimiLinearForCausalLM

    return KimiLinearForCausalLM(HFConfig(**{**KIMI, **kw}))


register_hf_model("kimi_linear", _kimi_linear)
register_hf_model("kimi_linear_q_lora", _kimi_linear, Q_LORA)
GROUPS = {"kimi_linear": ("kda_dense_layers", "kda_moe_layers", "mla_dense_layers", "mla_moe_layers"),
          "kimi_linear_q_lora": ("kda_moe_layers", "mla_dense_layers", "mla_moe_layers")}
IDS = token_ids(seq=70)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tp": 4})


@pytest.mark.parametrize(("kind", "scan_layers"), [("kimi_linear", True), ("kimi_linear_q_lora", False)])
def test_f32_logits_match_transformers(tiny_checkpoints, mesh, kind, scan_layers):
    """70 tokens: two chunks, the last one ragged (the padded and decoding tests run inputs shorter
    than a chunk)."""
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    assert report.unused_tensors == []
    assert tuple(g for g in GROUPS[kind] if hasattr(model, g)) == GROUPS[kind]
    if scan_layers:  # one stack per (mixer, feed-forward) kind
        assert model.kda_moe_layers.kda.q_conv[...].shape == (2, 32, 1, 4)
        assert model.kda_moe_layers.kda.A_log[...].shape == (2, 1, 1, 4, 1)
        assert model.mla_moe_layers.moe.experts.gate.kernel[...].shape == (1, 8, 32, 64)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(logits(model, IDS), reference_logits(torch_model, IDS))
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_get_the_logits_they_get_alone(tiny_checkpoints, mesh, side):
    """Pads enter neither a convolution window nor the recurrent state: each padded row's real
    positions equal transformers' logits of the row alone."""
    path, torch_model = tiny_checkpoints("kimi_linear")
    assert_padded_rows_alone(otfload.from_pretrained(path, mesh=mesh), torch_model, mesh, side)


def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh):
    """Scanned, on the kind with every layer group (the low-rank query's decoding step is its forward's
    projection, checked by the logits test)."""
    path, torch_model = tiny_checkpoints("kimi_linear")
    model = otfload.from_pretrained(path, mesh=mesh)
    cache = model.init_cache(3, 8)
    assert cache["layers"]["kda_moe_layers"]["state"].shape[1:] == (3, 4, 8, 8)
    assert cache["layers"]["kda_moe_layers"]["conv"].shape[1:] == (3, 3 * 32, 4)
    assert cache["layers"]["mla_moe_layers"]["k"].shape[1:] == (3, 8, 1, 16 + 8)
    assert_greedy_matches(model, torch_model, mesh=mesh)


def as_released(key: str) -> str:
    """transformers' save_pretrained names a dense MLP ``block_sparse_moe.*_proj``; the releases (and
    otfload's export) ``mlp.*_proj``."""
    for n in ("gate", "up", "down"):
        key = key.replace(f".block_sparse_moe.{n}_proj.", f".mlp.{n}_proj.")
    return key


@pytest.mark.parametrize(("kind", "scan_layers"), [("kimi_linear", True), ("kimi_linear_q_lora", False)])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh, tmp_path, kind, scan_layers):
    """Every tensor back under its released name, bit for bit; transformers loads the export."""
    from transformers import KimiLinearForCausalLM

    src, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=mesh, scan_layers=scan_layers)
    out = export_hf(model, tmp_path / "out", reference=src, max_shard_size="60KB")
    assert_bit_exact(read_tensors(out), {as_released(k): v for k, v in read_tensors(src).items()})
    ids = token_ids(seq=9)
    assert np.array_equal(torch_logits(KimiLinearForCausalLM.from_pretrained(out), ids), torch_logits(torch_model, ids))


@pytest.mark.parametrize("chunk", [0, 16])
def test_per_channel_gated_delta_rule_matches_numpy(chunk):
    """Per-key-channel decays (strong ones: whole chunks decay by far more than float32's range) in the
    chunked and token-by-token forms against the recurrence written out in numpy, from a state."""
    rng = np.random.default_rng(0)
    b, s, h, dk, dv = 2, 37, 2, 4, 3
    q, k = (rng.standard_normal((b, s, h, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((b, s, h, dv)).astype(np.float32)
    g = -rng.uniform(0, 8, (b, s, h, dk)).astype(np.float32)
    beta = rng.uniform(0, 1, (b, s, h)).astype(np.float32)
    state = rng.standard_normal((b, h, dk, dv)).astype(np.float32)
    ref, st = np.zeros((b, s, h, dv), np.float32), state.astype(np.float64)
    for t in range(s):
        st = st * np.exp(g[:, t])[..., None]
        delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", st, k[:, t])) * beta[:, t, :, None]
        st = st + k[:, t, :, :, None] * delta[:, :, None, :]
        ref[:, t] = np.einsum("bhkv,bhk->bhv", st, q[:, t])
    rule = recurrent_gated_delta_rule if chunk == 0 else lambda *a: gated_delta_rule(*a, chunk=chunk)
    out, final = rule(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(final), st, rtol=1e-4, atol=1e-4)


RELEASE_STYLE = {**{k: v for k, v in KIMI.items() if k not in ("layer_types", "linear_head_dim", "linear_num_heads")},
                 "model_type": "kimi_linear", "mla_use_nope": True, "moe_router_activation_func": "sigmoid",
                 "linear_attn_config": {"head_dim": 8, "num_heads": 4, "short_conv_kernel_size": 3,
                                        "kda_layers": [1, 3, 4], "full_attn_layers": [2, 5]}}


def test_the_releases_linear_attn_config_is_read_as_transformers_reads_it():
    """``linear_attn_config`` (1-based layer lists, the KDA sizes) and the MoE fields under the
    releases' names; without any layer list every 4th layer but the first is MLA."""
    cfg = KimiLinearConfig.from_hf(json.loads(json.dumps(
        {**RELEASE_STYLE, "num_experts": 8, "num_experts_per_token": 2, "num_expert_group": 2, "num_shared_experts": 2,
         "moe_renormalize": False, "first_k_dense_replace": 2, "mlp_layer_types": None})))
    assert cfg.layer_types == (LIN, FULL, LIN, LIN, FULL)
    assert (cfg.linear_head_dim, cfg.linear_num_heads, cfg.linear_conv_kernel_dim) == (8, 4, 3)
    assert cfg.kda_dense_layers == (0,) and cfg.mla_dense_layers == (1,) and cfg.kda_moe_layers == (2, 3)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.n_shared_experts) == (8, 2, 2, 2)
    assert cfg.norm_topk_prob is False
    default = KimiLinearConfig.from_hf({"model_type": "kimi_linear", "num_hidden_layers": 9})
    assert default.layer_types == (LIN, LIN, LIN, LIN, FULL, LIN, LIN, LIN, FULL)
    assert default.mlp_layer_types == ("dense",) + ("sparse",) * 8


@pytest.mark.parametrize(("field", "value"), [
    ("layer_types", [LIN, "sliding_attention", FULL, LIN, FULL]),
    ("layer_types", [LIN, FULL]),
    ("mlp_layer_types", ["dense", "moe", "sparse", "dense", "sparse"]),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("mla_use_nope", False),
    ("moe_router_activation_func", "softmax"),
    ("num_key_value_heads", 2),
    ("n_group", 3),
    ("num_experts_per_tok", 6),
    ("linear_conv_kernel_dim", 0),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**KIMI, "model_type": "kimi_linear", field: value}
    with pytest.raises(ConfigError) as err:
        KimiLinearConfig.from_hf(json.loads(json.dumps(config)))
    assert field in err.value.field


def test_release_layer_lists_that_miss_a_layer_are_refused():
    config = {**RELEASE_STYLE, "linear_attn_config": {**RELEASE_STYLE["linear_attn_config"], "kda_layers": [1, 3]}}
    with pytest.raises(ConfigError) as err:
        KimiLinearConfig.from_hf(config)
    assert err.value.field == "linear_attn_config.kda_layers"


def _full_size_headers(path):
    """A header-only checkpoint at transformers' KimiLinearConfig defaults (Kimi-Linear-48B-A3B's
    sizes: 27 layers, 6 MLA, 256 experts of 1024 on 26 layers), bf16 with the float32 router, as the
    release names its tensors; one file per layer."""
    from transformers import KimiLinearConfig as HFConfig

    from tests.realsize import write_header_checkpoint

    config = HFConfig().to_dict()
    cfg = KimiLinearConfig.from_hf(config)
    h, n, d, m = cfg.hidden_size, cfg.num_attention_heads, cfg.linear_dim, cfg.moe_intermediate_size
    bf16 = lambda *shape: ("BF16", shape)  # noqa: E731

    def swiglu(key: str, names: tuple[str, str, str], f: int) -> dict:
        return {key.format(names[0]): bf16(f, h), key.format(names[1]): bf16(f, h), key.format(names[2]): bf16(h, f)}

    shards = {}
    for i in range(cfg.num_hidden_layers):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        t = {f"{p}.input_layernorm.weight": bf16(h), f"{p}.post_attention_layernorm.weight": bf16(h)}
        if cfg.layer_types[i] == LIN:
            r, k = cfg.linear_head_dim, cfg.linear_conv_kernel_dim
            t |= {f"{a}.{x}_proj.weight": bf16(d, h) for x in "qkv"} | {f"{a}.{x}_conv1d.weight": bf16(d, 1, k)
                                                                          for x in "qkv"}
            t |= {f"{a}.A_log": ("F32", (1, 1, cfg.linear_num_heads, 1)), f"{a}.dt_bias": ("F32", (d,)),
                  f"{a}.b_proj.weight": bf16(cfg.linear_num_heads, h), f"{a}.o_norm.weight": bf16(r),
                  f"{a}.o_proj.weight": bf16(h, d)}
            t |= {f"{a}.{x}_a_proj.weight": bf16(r, h) for x in "fg"} | {f"{a}.{x}_b_proj.weight": bf16(d, r)
                                                                           for x in "fg"}
        else:
            t |= {f"{a}.q_proj.weight": bf16(n * cfg.qk_head_dim, h),
                  f"{a}.kv_a_proj_with_mqa.weight": bf16(cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
                  f"{a}.kv_a_layernorm.weight": bf16(cfg.kv_lora_rank),
                  f"{a}.kv_b_proj.weight": bf16(n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                  f"{a}.o_proj.weight": bf16(h, n * cfg.v_head_dim)}
        if cfg.mlp_layer_types[i] == "dense":
            t |= swiglu(f"{p}.mlp.{{}}_proj.weight", ("gate", "up", "down"), cfg.intermediate_size)
        else:
            moe = f"{p}.block_sparse_moe"
            t |= {f"{moe}.gate.weight": ("F32", (cfg.num_experts, h)),
                  f"{moe}.gate.e_score_correction_bias": ("F32", (cfg.num_experts,))}
            t |= swiglu(f"{moe}.shared_experts.{{}}_proj.weight", ("gate", "up", "down"), m * cfg.n_shared_experts)
            for e in range(cfg.num_experts):
                t |= swiglu(f"{moe}.experts.{e}.{{}}.weight", ("w1", "w3", "w2"), m)
        shards[f"model-{i + 1:05d}-of-{cfg.num_hidden_layers + 1:05d}.safetensors"] = t
    shards["model-last.safetensors"] = {"model.embed_tokens.weight": bf16(cfg.vocab_size, h),
                                        "model.norm.weight": bf16(h), "lm_head.weight": bf16(cfg.vocab_size, h)}
    return write_header_checkpoint(path, shards, config)


def test_full_size_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` of the full-size model (transformers' defaults: Kimi-Linear
    48B-A3B's sizes): every leaf planned, experts on ``ep``, within 10 s of CPU and 1 GiB, and one
    process's bytes within 1.1 x its devices' share of the checkpoint."""
    from tests.realsize import inspect_at_scale

    cpu, peak, info = inspect_at_scale(_full_size_headers(tmp_path / "kimi_linear"), "fsdp=16,ep=16")
    assert cpu <= 10 and peak <= 2**30, (cpu, peak)
    assert info["model_type"] == "kimi_linear" and info["unused"] == []
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    experts = leaves["kda_moe_layers.moe.experts.gate.kernel"]
    assert experts["shape"] == [20, 256, 1024, 2304] and "'ep'" in experts["sharding"], experts
    assert leaves["mla_moe_layers.attn.kv_a.kernel"]["shape"] == [6, 512, 2304]
    totals = info["totals"]
    assert 90e9 < totals["source_bytes"] < 105e9
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)


def test_eval_scores_padded_batches_like_transformers(tiny_checkpoints, mesh, tmp_path):
    """``otfload.evaluate`` (``otfload eval``) on texts of different lengths batched with padding:
    each text's summed NLL and token count equal transformers' loss on the text alone."""
    from tests.eval_support import TEXTS, reference_nll, with_tokenizer
    from tests.test_evaluate import MAX_LEN, assert_matches

    src, torch_model = tiny_checkpoints("kimi_linear")
    path = with_tokenizer(src, tmp_path / "ckpt")
    result = otfload.evaluate(path, TEXTS, max_len=MAX_LEN, batch_size=3, mesh=mesh, progress=False)
    assert_matches(result, reference_nll(torch_model, path / "tokenizer.json", TEXTS, MAX_LEN))
