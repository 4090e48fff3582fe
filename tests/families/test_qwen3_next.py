"""Qwen3-Next: tiny transformers checkpoints → otfload → logits, greedy ids and gradients equal
transformers' (its PyTorch reference kernels), padded rows equal to the rows alone, the export round
trip bit-exact, the per-key-head split of ``in_proj_qkvz`` / ``in_proj_ba`` equal to transformers'
``fix_query_key_value_ordering``, and the config fields otfload does not implement refused by name.

The tiny model has all four kinds of layer in one stack, out of the default order: Gated DeltaNet
and gated attention layers, each with routed experts plus the gated shared expert or with a dense
MLP (``mlp_only_layers``), two value heads per key head and 5- to 70-token inputs (more than one
64-token chunk); the helpers are :mod:`tests.families.test_qwen3_5`'s and
:mod:`tests.training.test_gradients`'. ``otfload.evaluate`` runs the padded forward the padded-rows
test checks on both sides; its own scoring of padded batches of recurrent hybrids is checked in
:mod:`tests.families.test_kimi_linear` and :mod:`tests.families.test_nemotron_h`."""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import otfload
from otfload.errors import AdapterError, ConfigError
from otfload.export import export_hf
from otfload.families.qwen3_next.config import Qwen3NextConfig
from otfload.plan.hooks import run_forward
from otfload.plan.sharding import make_mesh
from tests.export.test_export import assert_bit_exact, read_tensors
from tests.families.checks import assert_export_round_trip, assert_greedy_matches, reference_logits
from tests.families.test_qwen3_5 import FULL, LIN, assert_padded_rows_alone
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.training.test_gradients import (
    LEARNING_RATE,
    PAD,
    batch,
    exported_grads,
    next_token_loss,
    torch_loss_and_grads,
    train_step,
    with_pad_id,
)
from tests.training.test_gradients_gqa_families import assert_grads_match_unrouted_too

# Layers: linear+MoE, linear+MLP, attention+MoE, linear+MoE, attention+MLP. Four key heads, one per tp
# device of the 2 x 4 mesh (as the 80B's 16 on tp=4 or 16: the Gated DeltaNet runs by key head).
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=8, linear_value_head_dim=8, layer_types=[LIN, LIN, FULL, LIN, FULL],
            mlp_only_layers=[1, 4], num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48, max_position_embeddings=128,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
GROUPS = {"linear_layers": (0, 3), "linear_mlp_layers": (1,), "attention_layers": (2,), "attention_mlp_layers": (4,)}


def _qwen3_next(**kw):
    from transformers import Qwen3NextConfig as HFConfig
    from transformers import Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(HFConfig(**{**TINY, **kw}))


register_hf_model("qwen3_next", _qwen3_next)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh({"fsdp": 2, "tp": 4})


@pytest.mark.parametrize("scan_layers", [True, False])
def test_f32_logits_match_transformers(tiny_checkpoints, mesh, scan_layers):
    path, torch_model = tiny_checkpoints("qwen3_next")
    assert len(list(path.glob("*.safetensors"))) > 1
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    assert report.unused_tensors == []
    assert {g: getattr(model.cfg, g) for g in GROUPS} == GROUPS
    if scan_layers:  # the fused projections split per key head: (hk, rows, hidden)
        la = model.linear_layers.linear_attn
        assert la.q.kernel[...].shape == (2, 4, 8, 64) and la.v.kernel[...].shape == (2, 4, 16, 64)
        assert la.a.kernel[...].shape == (2, 4, 2, 64) and la.conv_v[...].shape == (2, 4, 16, 1, 4)
        assert la.q.kernel[...].sharding.spec[1] == "tp"  # a key head per tp device
    ids = token_ids(seq=70)  # two chunks, the last one ragged (the padded rows alone: one chunk)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(logits(model, ids), reference_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_split_equals_transformers_ordering(tiny_checkpoints):
    """The mapping's hooks on ``in_proj_qkvz`` / ``in_proj_ba`` give the q, k, v, z, b, a that
    transformers' ``fix_query_key_value_ordering`` derives from the fused projections' outputs."""
    import torch

    from otfload.families.qwen3_next.mapping import PROJECTIONS

    path, torch_model = tiny_checkpoints("qwen3_next")
    cfg = Qwen3NextConfig.from_hf(json.loads((path / "config.json").read_text())).to_dict()
    layer = torch_model.model.layers[0].linear_attn
    x = np.random.default_rng(0).normal(size=(2, 3, 64)).astype(np.float32)
    weights = {"in_proj_qkvz": layer.in_proj_qkvz.weight.detach().numpy(),
               "in_proj_ba": layer.in_proj_ba.weight.detach().numpy()}
    with torch.no_grad():
        ref = layer.fix_query_key_value_ordering(*(torch.tensor(x @ w.T) for w in weights.values()))
    hv = cfg["linear_num_value_heads"]
    for name, expected in zip("qkvzba", ref, strict=True):
        key, hooks = PROJECTIONS[f"linear_attn.{name}.kernel"]
        kernel = run_forward([h.resolve(cfg) for h in hooks], weights[key.split(".")[1]])
        ours = np.einsum("bsh,kdh->bskd", x, kernel)
        expected = expected.numpy()
        if name in "vzba":  # transformers' value-head layout
            ours = ours.reshape(expected.shape) if name in "vz" else ours.reshape(2, 3, hv)
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-6, err_msg=name)


def test_padded_rows_get_the_logits_they_get_alone(tiny_checkpoints, mesh):
    """Pads enter neither a convolution window nor the recurrent state, on either side."""
    path, torch_model = tiny_checkpoints("qwen3_next")
    model = otfload.from_pretrained(path, mesh=mesh)
    for side in ("left", "right"):
        assert_padded_rows_alone(model, torch_model, mesh, side)


def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh):
    """Scanned: the unscanned cache of the same Gated DeltaNet and gated attention layers decodes in
    :mod:`tests.families.test_qwen3_5`'s greedy test (``qwen3_5_moe``, unscanned)."""
    path, torch_model = tiny_checkpoints("qwen3_next")
    model = otfload.from_pretrained(path, mesh=mesh)
    cache = model.init_cache(3, 8)
    layers = cache["layers"]
    assert layers["linear_layers"]["state"].shape == (2, 3, 8, 8, 8)
    assert layers["linear_mlp_layers"]["conv"].shape == (1, 3, 2 * 32 + 64, 4)
    assert layers["attention_mlp_layers"]["k"].shape == (1, 3, 8, 2, 16)
    assert_greedy_matches(model, torch_model, mesh=mesh, crop=0)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, tmp_path, mesh, scan_layers):
    src, _ = tiny_checkpoints("qwen3_next")
    model = otfload.from_pretrained(src, mesh=mesh, scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out", ordered=False)
    if not scan_layers:  # without a reference, the fused tensors' shapes come from the slices they join
        assert_bit_exact(read_tensors(export_hf(model, tmp_path / "bare")), read_tensors(src))


def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, mesh):
    src, torch_model = tiny_checkpoints("qwen3_next")
    path = with_pad_id(src, tmp_path / "ckpt")
    model = otfload.from_pretrained(path, mesh=mesh, dtype=jnp.float32)
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = train_step(model, optimizer, jnp.asarray(ids))
        after = nnx.jit(next_token_loss)(model, jnp.asarray(ids))
    ref_loss, ref_grads = torch_loss_and_grads(torch_model, ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_grads_match_unrouted_too(exported_grads(grads, path, tmp_path / "grads"), ref_grads)
    assert float(after) < float(loss)


FUSED = ["in_proj_qkvz", "in_proj_ba"]  # split between leaves: factors otfload merges only
MODULES = ["out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "shared_expert_gate"]
# PEFT 0.21 turns these into its fused-expert targets on an MoE layer (EXPERTS), the dense layers' MLPs kept.
MLP = ["gate_proj", "up_proj", "down_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("merge_adapter", [True, False])
def test_peft_lora_matches_peft_merged(tiny_checkpoints, tmp_path, mesh, merge_adapter):
    """A PEFT adapter on the projections PEFT targets (transformers' runtime names: the fused
    ``in_proj_qkvz``/``in_proj_ba`` a device reads by key head, ``out_proj``, the attention, the
    shared experts' gate and, merged only, the fused projections, the dense MLPs and the routed
    experts fused as ``gate_up_proj``/``down_proj``, whose factors otfload cannot keep yet), merged on
    the fly and kept as factors: logits equal those of ``PeftModel.merge_and_unload()``, which the
    adapter moves well past the bound; keeping the fused projections' factors is a typed error."""
    from peft import PeftModel

    from otfload.adapters.weight import LoraWeight
    from tests.adapters.support import make_adapter

    path, torch_model = tiny_checkpoints("qwen3_next")
    lora = dict(target_modules=FUSED + MODULES + MLP, target_parameters=EXPERTS) if merge_adapter else dict(
        target_modules=MODULES)
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4, **lora)
    ids = token_ids(seq=70)
    reference = torch_logits(PeftModel.from_pretrained(copy.deepcopy(torch_model), adapter).merge_and_unload(), ids)
    model = otfload.from_pretrained(path, adapter=adapter, merge_adapter=merge_adapter, mesh=mesh)
    kept = [w for w in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, LoraWeight))
            if isinstance(w, LoraWeight)]
    assert bool(kept) != merge_adapter
    with jax.set_mesh(mesh):
        assert max_rel_diff(logits(model, ids), reference) <= 1e-4
    assert max_rel_diff(reference_logits(torch_model, ids), reference) > 1e-3
    if not merge_adapter:
        fused = make_adapter(torch_model, tmp_path / "fused", r=2, lora_alpha=4, target_modules=FUSED)
        with pytest.raises(AdapterError, match="linear_attn.+fused projection"):
            otfload.from_pretrained(path, adapter=fused, merge_adapter=False, mesh=mesh)


def test_groups_follow_decoder_sparse_step_and_the_defaults():
    cfg = Qwen3NextConfig.from_hf({**{k: v for k, v in TINY.items() if k not in ("layer_types", "head_dim")},
                                   "model_type": "qwen3_next", "num_hidden_layers": 8, "decoder_sparse_step": 2,
                                   "mlp_only_layers": [5]})
    assert cfg.layer_types == (LIN, LIN, LIN, FULL) * 2 and cfg.head_dim == 256  # transformers' defaults
    assert (cfg.linear_layers, cfg.attention_layers) == ((1,), (3, 7))
    assert (cfg.linear_mlp_layers, cfg.attention_mlp_layers) == ((0, 2, 4, 5, 6), ())
    dense = Qwen3NextConfig.from_hf({**TINY, "model_type": "qwen3_next", "num_experts": 0})
    assert dense.num_experts == 0 and dense.linear_layers == dense.attention_layers == ()


@pytest.mark.parametrize(("field", "value"), [
    ("layer_types", [LIN, "sliding_attention", FULL, LIN, FULL]),
    ("layer_types", [LIN, FULL]),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("mamba_ssm_dtype", "bfloat16"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64}),
    ("linear_num_value_heads", 3),
    ("mlp_only_layers", [7]),
    ("decoder_sparse_step", 0),
    ("linear_conv_kernel_dim", 0),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**TINY, "model_type": "qwen3_next", field: value}
    with pytest.raises(ConfigError) as err:
        Qwen3NextConfig.from_hf(json.loads(json.dumps(config)))
    assert field in err.value.field


def _full_size_headers(path):
    """A header-only checkpoint of Qwen3-Next-80B-A3B: transformers' Qwen3NextConfig defaults, which
    are the release's shapes but for ``intermediate_size`` (5632; the release's 5120, read by no layer:
    every layer has experts) and ``max_position_embeddings`` (32768; 262144), set as published; bf16,
    one file per layer, the release's names (experts per expert, a multi-token-prediction tensor)."""
    from transformers import Qwen3NextConfig as HFConfig

    from tests.realsize import write_header_checkpoint

    config = HFConfig(intermediate_size=5120, max_position_embeddings=262144).to_dict()
    cfg = Qwen3NextConfig.from_hf(config)
    h, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    hk, hv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    bf16 = lambda *shape: ("BF16", shape)  # noqa: E731

    def swiglu(key: str, f: int) -> dict:
        return {key.format("gate"): bf16(f, h), key.format("up"): bf16(f, h), key.format("down"): bf16(h, f)}

    shards = {}
    for i, kind in enumerate(cfg.layer_types):
        p = f"model.layers.{i}"
        t = {f"{p}.input_layernorm.weight": bf16(h), f"{p}.post_attention_layernorm.weight": bf16(h)}
        if kind == LIN:
            a = f"{p}.linear_attn"
            t |= {f"{a}.in_proj_qkvz.weight": bf16(2 * hk * dk + 2 * hv * dv, h),
                  f"{a}.in_proj_ba.weight": bf16(2 * hv, h),
                  f"{a}.conv1d.weight": bf16(cfg.conv_dim, 1, cfg.linear_conv_kernel_dim), f"{a}.dt_bias": bf16(hv),
                  f"{a}.A_log": bf16(hv), f"{a}.norm.weight": bf16(dv), f"{a}.out_proj.weight": bf16(h, hv * dv)}
        else:
            a = f"{p}.self_attn"
            t |= {f"{a}.q_proj.weight": bf16(2 * n * d, h), f"{a}.k_proj.weight": bf16(kv * d, h),
                  f"{a}.v_proj.weight": bf16(kv * d, h), f"{a}.o_proj.weight": bf16(h, n * d),
                  f"{a}.q_norm.weight": bf16(d), f"{a}.k_norm.weight": bf16(d)}
        t |= {f"{p}.mlp.gate.weight": bf16(cfg.num_experts, h), f"{p}.mlp.shared_expert_gate.weight": bf16(1, h)}
        t |= swiglu(f"{p}.mlp.shared_expert.{{}}_proj.weight", cfg.shared_expert_intermediate_size)
        for e in range(cfg.num_experts):
            t |= swiglu(f"{p}.mlp.experts.{e}.{{}}_proj.weight", cfg.moe_intermediate_size)
        shards[f"model-{i + 1:05d}-of-{cfg.num_hidden_layers + 1:05d}.safetensors"] = t
    shards["model-last.safetensors"] = {"model.embed_tokens.weight": bf16(cfg.vocab_size, h),
                                        "model.norm.weight": bf16(h), "lm_head.weight": bf16(cfg.vocab_size, h),
                                        "mtp.fc.weight": bf16(h, 2 * h)}
    return write_header_checkpoint(path, shards, config)


def test_full_size_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` of the full-size Qwen3-Next-80B-A3B (48 layers, 36 Gated
    DeltaNet and 12 attention, 512 experts each; 74k stored tensors) on fsdp x ep: every leaf planned
    but the multi-token-prediction head, within 10 s of CPU (the child's own) and 1 GiB (its own
    peak), and one process's bytes, held and fetched, within 1.1 x its devices' share."""
    from tests.realsize import inspect_at_scale

    cpu, peak, info = inspect_at_scale(_full_size_headers(tmp_path / "qwen3_next"), "fsdp=16,ep=16")
    assert cpu <= 10 and peak <= 2**30, (cpu, peak)
    assert info["model_type"] == "qwen3_next" and info["unused"] == ["mtp.fc.weight"]
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    experts = leaves["linear_layers.moe.gate.kernel"]
    assert experts["shape"] == [36, 512, 512, 2048] and "'ep'" in experts["sharding"], experts
    assert leaves["linear_layers.linear_attn.v.kernel"]["shape"] == [36, 16, 2 * 128, 2048]
    assert leaves["attention_layers.attn.q.kernel"]["shape"] == [12, 16, 512, 2048]
    totals = info["totals"]
    assert 150e9 < totals["source_bytes"] < 165e9, totals
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)
