"""Nemotron-H (``nemotron_h``, Nemotron-3): tiny transformers checkpoints → otfload → logits and
greedy ids equal transformers' (its PyTorch reference path: ``mamba_ssm`` and ``causal_conv1d`` are
not installed), padded rows equal to the rows alone, the export round trip bit-exact, the published
Nemotron-3-Nano-30B-A3B config planned at 256 devices, and the config fields otfload does not
implement refused by name.

The tiny model mixes every block kind out of transformers' default order (Mamba-2, attention, MoE,
Mamba-2, MLP) with grouped Mamba heads (8 heads in 2 groups), the conv bias, 32-token chunks and 13-
to 70-token inputs (more than one chunk, a ragged last one); 8 routed experts in 2 groups (the best
group only) by sigmoid score plus a random correction bias, scaled by 2.5, with a shared expert. The
variant adds the Mamba projections' and the MLPs' biases."""

import json
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.errors import ConfigError
from otfload.export import export_hf
from otfload.families.nemotron_h import NemotronHConfig
from otfload.models import mamba2
from otfload.models.layers import pure
from otfload.plan.sharding import make_mesh
from tests.export.test_export import assert_bit_exact, read_tensors, weight_map_keys
from tests.families.checks import reference_greedy, reference_logits
from tests.families.test_deepseek import _randomize_router_bias
from tests.families.test_qwen3_5 import MASKED_FORWARD
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, register_hf_model, token_ids
from tests.models.kinds import padded_batch
from tests.realsize import Spec, inspect_at_scale, write_header_checkpoint

M, A, E, D = "linear_attention", "full_attention", "moe", "mlp"
REALCONFIGS = Path(__file__).resolve().parents[3] / "shared" / "realconfigs"
NANO = REALCONFIGS / "nvidia__NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.json"
TINY = dict(vocab_size=256, hidden_size=64, layers_block_type=[M, A, E, M, D], num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, intermediate_size=96, mamba_num_heads=8, mamba_head_dim=8,
            n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=32, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48, max_position_embeddings=128)
NEW = 6


def _nemotron_h(**kw):
    from transformers import NemotronHConfig as HfNemotronHConfig
    from transformers import NemotronHForCausalLM

    model = NemotronHForCausalLM(HfNemotronHConfig(**{**TINY, **kw}))
    _randomize_router_bias(model)
    return model


register_hf_model("nemotron_h", _nemotron_h)
register_hf_model("nemotron_h_bias", _nemotron_h, {"use_bias": True, "mlp_bias": True})
# Nemotron-3 Super's latent MoE: routed experts in a 16-wide latent space, biased projections in and out.
register_hf_model("nemotron_h_latent", _nemotron_h, {"moe_latent_size": 16, "mlp_bias": True})


@pytest.mark.parametrize(("scan_layers", "axes"), [(True, {"fsdp": 2, "tp": 4}), (False, {"fsdp": 2, "ep": 4})])
def test_f32_logits_match_transformers(tiny_checkpoints, scan_layers, axes):
    """The variant with biases is checked against transformers by the padding test (each row's logits
    = transformers' of the row alone)."""
    path, torch_model = tiny_checkpoints("nemotron_h")
    assert len(list(path.glob("*.safetensors"))) > 1
    mesh = make_mesh(axes)
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    assert report.unused_tensors == []
    if scan_layers:  # each block kind: one stack of its own shapes
        assert model.mamba_layers.mixer.in_proj.kernel[...].shape == (2, 64 + 128 + 8, 64)
        assert model.moe_layers.mixer.experts.up.kernel[...].shape == (1, 8, 32, 64)
    with jax.set_mesh(mesh):
        # one chunk, and three with a ragged last one; unscanned, the same chunked recurrence on 70
        # tokens only (one program less to compile)
        for seq in (13, 70) if scan_layers else (70,):
            ids = token_ids(seq=seq)
            diff = max_rel_diff(logits(model, ids), reference_logits(torch_model, ids))
            assert diff <= 1e-4, (seq, diff)


@pytest.mark.parametrize(("scan_layers", "axes"), [(True, {"fsdp": 2, "tp": 4}), (False, {"fsdp": 2, "ep": 4})])
def test_latent_moe_logits_match_transformers(tiny_checkpoints, scan_layers, axes):
    """``moe_latent_size``: the routed experts run 16 wide between ``fc1_latent_proj`` and
    ``fc2_latent_proj`` (both biased), routing and the shared expert on the full width."""
    path, torch_model = tiny_checkpoints("nemotron_h_latent")
    mesh = make_mesh(axes)
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    assert report.unused_tensors == []
    moe = model.moe_layers.mixer if scan_layers else model.moe_layers[0].mixer
    lead = (1,) if scan_layers else ()
    assert moe.latent_in.kernel[...].shape == (*lead, 16, 64) and moe.latent_out.bias[...].shape == (*lead, 64)
    assert moe.experts.up.kernel[...].shape == (*lead, 8, 32, 16)
    ids = token_ids(seq=13)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(logits(model, ids), reference_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_the_mixer_is_the_same_recurrence_in_every_form():
    """Chunked (a ragged last chunk), token by token and quadratic give the same outputs and final
    state; a prompt run in two calls through the cache (32-token chunks) equals it run in one."""
    cfg = NemotronHConfig.from_hf({**TINY, "model_type": "nemotron_h"})
    p = pure(mamba2.Mamba2(cfg, dtype=jnp.float32, rngs=nnx.Rngs(0)))
    p["A_log"] = jnp.log(jnp.linspace(1.0, 4.0, 8))
    forward = jax.jit(mamba2.mamba2_forward, static_argnames=("cfg", "chunk"))
    h = jnp.asarray(np.random.default_rng(0).normal(size=(2, 44, 64)), jnp.float32)
    cache = {"conv": jnp.zeros((2, mamba2.conv_dim(cfg), 4)), "state": jnp.zeros((2, 8, 8, 16))}
    ref, ref_cache = forward(p, h, cfg, None, cache, chunk=0)
    bound = 1e-5 * float(jnp.abs(ref).max())
    for chunk in (7, 44):
        out, new = forward(p, h, cfg, None, cache, chunk=chunk)
        assert float(jnp.abs(out - ref).max()) <= bound, chunk
        assert float(jnp.abs(new["state"] - ref_cache["state"]).max()) <= 1e-5, chunk
    # two halves of one shape: the second call reuses the first's program
    first, mid = forward(p, h[:, :22], cfg, None, cache)
    second, end = forward(p, h[:, 22:], cfg, None, mid)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), ref, atol=bound)
    np.testing.assert_array_equal(end["conv"], ref_cache["conv"])
    np.testing.assert_allclose(end["state"], ref_cache["state"], atol=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_get_the_logits_they_get_alone(tiny_checkpoints, mesh_2x4, side):
    """Pads enter neither a convolution window nor the recurrent state (the variant's in_proj bias
    would put them in the window were they not zeroed after the projection too): each padded row's
    real positions equal transformers' logits of the row alone."""
    path, torch_model = tiny_checkpoints("nemotron_h_bias")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids, mask, _ = padded_batch(side)
    with jax.set_mesh(mesh_2x4):
        ours = np.asarray(MASKED_FORWARD(model, ids, mask))  # both sides: one program
    for r in range(len(ids)):
        real = mask[r].astype(bool)
        alone = reference_logits(torch_model, ids[r : r + 1, real])[0]
        assert max_rel_diff(ours[r, real], alone) <= 1e-4, (side, r)


def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh_2x4):
    """Scanned (one scan value: the cache's decoding steps are the same per layer either way)."""
    path, torch_model = tiny_checkpoints("nemotron_h")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    cache = model.init_cache(3, 8)
    assert cache["layers"]["mamba_layers"]["state"].shape == (2, 3, 8, 8, 16)  # [b, heads, head_dim, state]
    assert cache["layers"]["mamba_layers"]["state"].dtype == jnp.float32
    assert cache["layers"]["mamba_layers"]["conv"].shape == (2, 3, 128, 4)  # [b, conv_dim, K]
    ids, mask, _ = padded_batch("left")
    with jax.set_mesh(mesh_2x4):
        ours = np.asarray(otfload.generate(model, ids, max_new_tokens=NEW, attention_mask=mask, eos_token_id=[]))
    np.testing.assert_array_equal(ours, reference_greedy(torch_model, ids, mask, NEW, eos_token_id=None))


def test_time_step_clamp_as_transformers_applies_it():
    """Time steps below ``time_step_min``, no skip term to hide the state's part: the mixer's output
    over a prompt and then one token through the cache equals transformers' mixer's (its prefill
    clamps the time step, its one-token step does not, as mamba_ssm's kernels do)."""
    import torch
    from transformers import DynamicCache

    from tests.helpers import randomize_

    torch.manual_seed(0)
    torch_model = _nemotron_h()
    randomize_(torch_model)
    mixer = torch_model.model.layers[0].mixer
    with torch.no_grad():
        mixer.dt_bias.copy_(torch.linspace(-12.0, -8.0, 8))
        mixer.D.zero_()
        h = torch.randn(2, 12, 64, generator=torch.Generator().manual_seed(0))
        cache = DynamicCache(config=torch_model.config)
        ref = [mixer(h[:, :-1], cache=cache).numpy(), mixer(h[:, -1:], cache=cache).numpy()]
    weights = {name: jnp.asarray(t.detach().numpy()) for name, t in mixer.named_parameters()}
    p = {"in_proj": {"kernel": weights["in_proj.weight"]}, "conv": weights["conv1d.weight"],
         "conv_bias": weights["conv1d.bias"], "norm": {"scale": weights["norm.weight"]},
         "out_proj": {"kernel": weights["out_proj.weight"]}, **{k: weights[k] for k in ("dt_bias", "A_log", "D")}}
    cfg = NemotronHConfig.from_hf({**TINY, "model_type": "nemotron_h"})
    ours = mamba2.mamba2_forward(p, jnp.asarray(h[:, :-1].numpy()), cfg, None,
                                 {"conv": jnp.zeros((2, 128, 4)), "state": jnp.zeros((2, 8, 8, 16))})
    step = mamba2.mamba2_forward(p, jnp.asarray(h[:, -1:].numpy()), cfg, None, ours[1])
    for got, want in zip((ours[0], step[0]), ref, strict=True):
        assert max_rel_diff(got, want) <= 1e-4, max_rel_diff(got, want)


@pytest.mark.parametrize(("kind", "scan_layers"), [("nemotron_h", True), ("nemotron_h", False),
                                                   ("nemotron_h_bias", True), ("nemotron_h_latent", False)])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, kind, scan_layers):
    src, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan_layers)
    out = export_hf(model, tmp_path / "out", reference=src, max_shard_size="60KB")
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert weight_map_keys(out) == weight_map_keys(src)


def test_peft_lora_merges_like_peft(tiny_checkpoints, mesh_2x4, tmp_path):
    """A PEFT adapter on the projections PEFT targets (transformers' runtime names under ``model.``:
    attention, the Mamba-2 ``in_proj`` (PEFT refuses its ``out_proj`` and ``conv1d``), the MLPs' and
    shared experts' ``up_proj``/``down_proj``, the routed experts' fused parameters) merges on the
    fly: logits equal ``PeftModel``'s, and the adapter moves them well past the bound."""
    from tests.adapters.support import make_adapter, peft_logits

    path, torch_model = tiny_checkpoints("nemotron_h")
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4,
                           target_modules=["q_proj", "v_proj", "in_proj", "up_proj", "down_proj"],
                           target_parameters=["mixer.experts.up_proj", "mixer.experts.down_proj"])
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh_2x4)
    assert max_rel_diff(logits(model, ids), reference) <= 1e-4
    assert max_rel_diff(reference_logits(torch_model, ids), reference) > 1e-3


def test_eval_scores_padded_batches_like_transformers(tiny_checkpoints, mesh_2x4, tmp_path):
    """``otfload.evaluate`` (``otfload eval``) on texts of different lengths batched with padding:
    each text's summed NLL and token count equal transformers' loss on the text alone."""
    from tests.eval_support import TEXTS, reference_nll, with_tokenizer
    from tests.test_evaluate import MAX_LEN, assert_matches

    src, torch_model = tiny_checkpoints("nemotron_h")
    path = with_tokenizer(src, tmp_path / "ckpt")
    result = otfload.evaluate(path, TEXTS, max_len=MAX_LEN, batch_size=3, mesh=mesh_2x4, progress=False)
    assert_matches(result, reference_nll(torch_model, path / "tokenizer.json", TEXTS, MAX_LEN))


def test_rows_packing_several_sequences_are_refused(tiny_checkpoints, mesh_2x4):
    """A row of several sequences (lm-eval's packed ``segments``) would run the Mamba-2 state from one
    into the next: refused by name, never silently wrong."""
    from otfload.errors import UnsupportedModelError
    from otfload.models.attention import make_context

    path, _ = tiny_checkpoints("nemotron_h")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = jnp.asarray(token_ids(seq=6))
    ctx = make_context(ids, None, None, None, segments=(np.array([[1, 1, 1, 2, 2, 2]] * 2),) * 2)
    with pytest.raises(UnsupportedModelError, match="segments"):
        model.forward(ids, ctx, None)


@pytest.mark.parametrize(("field", "value"), [
    ("layers_block_type", [M, A, "sliding_attention", M, D]),
    ("hybrid_override_pattern", "M*EX-"),
    ("mamba_hidden_act", "gelu"),
    ("mlp_hidden_act", "silu"),
    ("mamba_ssm_cache_dtype", "bfloat16"),
    ("attention_bias", True),
    ("sliding_window", 64),
    ("n_groups", 3),
    ("n_group", 3),
    ("conv_kernel", 0),
])  # fmt: skip
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**TINY, "model_type": "nemotron_h", field: value}
    if field == "hybrid_override_pattern":
        del config["layers_block_type"]
    with pytest.raises(ConfigError) as err:
        NemotronHConfig.from_hf(json.loads(json.dumps(config)))
    assert err.value.field.startswith(field)


def test_block_pattern_and_legacy_names_follow_transformers():
    base = {k: v for k, v in TINY.items() if k not in ("layers_block_type", "n_groups", "conv_kernel")}
    cfg = NemotronHConfig.from_hf({**base, "model_type": "nemotron_h", "hybrid_override_pattern": "M-M*E",
                                   "mamba_n_groups": 4, "mamba_d_conv": 3, "num_hidden_layers": 7})
    assert cfg.layers_block_type == (M, D, M, A, E) and cfg.num_hidden_layers == 5
    assert (cfg.mamba_layers, cfg.mlp_layers, cfg.attention_layers, cfg.moe_layers) == ((0, 2), (1,), (3,), (4,))
    assert (cfg.n_groups, cfg.conv_kernel) == (4, 3)
    assert NemotronHConfig.from_hf({**base, "model_type": "nemotron_h"}).layers_block_type == (M, E, A, D)


def nano_headers(path: Path, store: Callable[[str, Spec], dict[str, Spec]] | None = None,
                 extra: dict | None = None) -> Path:
    """Nemotron-3-Nano-30B-A3B at full size, headers only: its published config (updated by ``extra``)
    and every tensor its BF16 release stores (the correction bias float32), under ``backbone.``, four
    layers a file; ``store(key, spec)`` gives the tensors a quantized release stores instead."""
    raw = {**json.loads(NANO.read_text()), **(extra or {})}
    cfg = NemotronHConfig.from_hf(raw)
    h, heads, inner = cfg.hidden_size, cfg.mamba_num_heads, mamba2.inner_dim(cfg)
    conv, e, m = mamba2.conv_dim(cfg), cfg.num_experts, cfg.moe_intermediate_size
    layers = []
    for i, kind in enumerate(cfg.layers_block_type):
        x = f"backbone.layers.{i}.mixer"
        t = {f"backbone.layers.{i}.norm.weight": ("BF16", (h,))}
        if kind == M:
            t |= {f"{x}.in_proj.weight": ("BF16", (inner + conv + heads, h)),
                  f"{x}.conv1d.weight": ("BF16", (conv, 1, cfg.conv_kernel)), f"{x}.conv1d.bias": ("BF16", (conv,)),
                  f"{x}.dt_bias": ("BF16", (heads,)), f"{x}.A_log": ("BF16", (heads,)), f"{x}.D": ("BF16", (heads,)),
                  f"{x}.norm.weight": ("BF16", (inner,)), f"{x}.out_proj.weight": ("BF16", (h, inner))}
        elif kind == A:
            q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
            t |= {f"{x}.{n}_proj.weight": ("BF16", shape)
                  for n, shape in (("q", (q, h)), ("k", (kv, h)), ("v", (kv, h)), ("o", (h, q)))}
        else:
            s = cfg.moe_shared_expert_intermediate_size
            t |= {f"{x}.gate.weight": ("BF16", (e, h)), f"{x}.gate.e_score_correction_bias": ("F32", (e,)),
                  f"{x}.shared_experts.up_proj.weight": ("BF16", (s, h)),
                  f"{x}.shared_experts.down_proj.weight": ("BF16", (h, s))}
            for j in range(e):
                t |= {f"{x}.experts.{j}.up_proj.weight": ("BF16", (m, h)),
                      f"{x}.experts.{j}.down_proj.weight": ("BF16", (h, m))}
        layers.append(t)
    files = -(-len(layers) // 4) + 1
    shards = {f"model-{k + 1:05d}-of-{files:05d}.safetensors": {n: v for t in layers[4 * k : 4 * k + 4]
                                                                for n, v in t.items()} for k in range(files - 1)}
    shards[f"model-{files:05d}-of-{files:05d}.safetensors"] = {
        "backbone.embeddings.weight": ("BF16", (cfg.vocab_size, h)), "backbone.norm_f.weight": ("BF16", (h,)),
        "lm_head.weight": ("BF16", (cfg.vocab_size, h))}
    if store is not None:
        shards = {f: {k: v for key, spec in t.items() for k, v in store(key, spec).items()} for f, t in shards.items()}
    return write_header_checkpoint(path, shards, raw)


@pytest.mark.skipif(not NANO.is_file(), reason="../shared/realconfigs is not checked out")
def test_published_nano_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` of the full-size Nemotron-3-Nano-30B-A3B (52 layers: 23
    Mamba-2, 6 attention, 23 MoE of 128 experts; 6k stored tensors) on fsdp x tp: every leaf planned,
    within 10 s of CPU (the child's own time) and 1 GiB (its own peak), and one process's bytes, held
    and fetched, within 1.1 x its devices' share of the checkpoint."""
    path = nano_headers(tmp_path / "nano")
    cpu, peak, info = inspect_at_scale(path, "fsdp=32,tp=8")
    assert cpu <= 10 and peak <= 2**30, (cpu, peak)
    assert info["model_type"] == "nemotron_h" and info["unused"] == []
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    experts = leaves["moe_layers.mixer.experts.up.kernel"]
    assert experts["shape"] == [23, 128, 1856, 2688] and "'tp', 'fsdp'" in experts["sharding"], experts
    assert leaves["mamba_layers.mixer.in_proj.kernel"]["shape"] == [23, 4096 + 6144 + 64, 2688]
    totals = info["totals"]
    assert 58e9 < totals["source_bytes"] < 66e9, totals
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)
