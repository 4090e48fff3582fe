"""Gemma 4: tiny transformers checkpoints → otfload → logits and greedy ids equal transformers', the
export round trip bit-exact, the published 26B-A4B config planned at 256 devices, and the config
fields otfload does not implement refused by name.

The tiny models cover every kind of layer: sliding (window 4 on 12-token inputs, so it bites) and
full layers of another head size and kv-head count, keys that are the values on full layers
(``attention_k_eq_v``), proportional RoPE rotating a quarter of the full layers' dims, random
``layer_scalar`` buffers, the final soft-cap; the MoE block beside the dense MLP; per-layer embeddings
with a tail of layers sharing keys and values (and twice as wide MLPs); the multimodal wrapper's text
model (its vision tower never read)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import otfload
from otfload.errors import ConfigError
from otfload.families.gemma4.config import Gemma4Config
from otfload.plan.sharding import make_mesh
from tests.families.checks import NEW, assert_export_round_trip, assert_greedy_matches, write_replica
from tests.helpers import hf_tensors, max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.helpers import jax_logits as logits
from tests.models.kinds import padded_batch

S, F = "sliding_attention", "full_attention"
REALCONFIGS = Path(__file__).resolve().parents[3] / "shared" / "realconfigs"
GEMMA4_26B = REALCONFIGS / "google__gemma-4-26B-A4B.json"
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
            attention_k_eq_v=True, sliding_window=4, layer_types=[S, S, F, S, S, F], final_logit_softcapping=30.0,
            hidden_size_per_layer_input=0, max_position_embeddings=128)
MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
# Layers 3-5 reuse the keys and values of layer 2 (sliding) and layer 1 (full).
PLE = {"attention_k_eq_v": False, "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 256,
       "num_kv_shared_layers": 3, "use_double_wide_mlp": True, "layer_types": [S, F, S, S, S, F]}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=4, position_embedding_size=16)


def _random_layer_scalars(model) -> None:
    """``layer_scalar`` is a buffer (saved, but not among the parameters the helpers randomise)."""
    import torch

    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(torch.rand(1) + 0.5)


def _gemma4(**kw):
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    model = Gemma4ForCausalLM(Gemma4TextConfig(**{**TEXT, **kw}))
    _random_layer_scalars(model)
    return model


def _gemma4_multimodal(**kw):
    from transformers import Gemma4Config as HfGemma4Config
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration(HfGemma4Config(text_config={**TEXT, **kw}, vision_config=VISION))
    _random_layer_scalars(model)
    return model


register_hf_model("gemma4", _gemma4)
register_hf_model("gemma4_untied", _gemma4, {"attention_k_eq_v": False, "tie_word_embeddings": False})
register_hf_model("gemma4_moe", _gemma4, MOE)
register_hf_model("gemma4_ple", _gemma4, PLE)
register_hf_model("gemma4_multimodal", _gemma4_multimodal)
MESHES = {"gemma4": {"fsdp": 2, "tp": 4}, "gemma4_moe": {"fsdp": 2, "ep": 4}}


def _mesh(kind):
    return make_mesh(MESHES.get(kind, MESHES["gemma4"]))


# Gemma 4, its MoE and PLE kinds with both scan values; the untied and multimodal ones with one each.
@pytest.mark.parametrize(("kind", "scan_layers"), [
    ("gemma4", True), ("gemma4", False), ("gemma4_moe", True), ("gemma4_moe", False), ("gemma4_ple", True),
    ("gemma4_ple", False), ("gemma4_untied", False), ("gemma4_multimodal", True),
])  # fmt: skip
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers):
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    mesh = _mesh(kind)
    model, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    if kind == "gemma4_multimodal":  # the vision tower: listed, never read
        assert report.unused_tensors and all(".vision_tower." in k or "embed_vision" in k
                                             for k in report.unused_tensors)
    else:
        assert report.unused_tensors == []
    if scan_layers and kind == "gemma4":  # sliding and full layers: two stacks of their own shapes
        assert model.sliding_layers.attn.q.kernel[...].shape == (4, 4, 16, 64)
        assert model.full_layers.attn.k.kernel[...].shape == (2, 1, 32, 64)
        assert not hasattr(model.full_layers.attn, "v")  # keys are the values
    ids = token_ids(seq=12)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_window_rope_and_layer_scalar_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: a wider window, plain RoPE on full layers, or all layer
    scalars 1 change the logits by more than twice its tolerance."""
    import dataclasses

    path, torch_model = tiny_checkpoints("gemma4")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    cfg = model.cfg
    for changed in (dataclasses.replace(cfg, sliding_window=64), dataclasses.replace(cfg, rope_full=(1e6, 1.0, 1.0))):
        model.cfg = changed
        assert max_rel_diff(logits(model, ids), ref) > 2e-4
    model.cfg = cfg
    model.full_layers.layer_scalar[...] = np.ones((2, 1), np.float32)
    assert max_rel_diff(logits(model, ids), ref) > 2e-4


# Scanned (the cache is the generic one of every family, checked unscanned by other families' tests):
# Gemma 4, its MoE and PLE (the shared layers' cache).
@pytest.mark.parametrize("kind", ["gemma4", "gemma4_moe", "gemma4_ple"])
def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, kind):
    path, torch_model = tiny_checkpoints(kind)
    mesh = _mesh(kind)
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=True)
    if kind == "gemma4_ple":  # the shared layers keep no cache of their own
        assert set(model.cache_layout()) == {"sliding_layers", "full_layers"}
        assert model.cache_layout()["full_layers"][0] == 1
    assert NEW > 4  # enough new tokens to cross the window while decoding
    assert_greedy_matches(model, torch_model, mesh=mesh)


# Both scan values where the stacks differ in kind (MoE, the PLE's shared layers); the untied and
# multimodal kinds change only the embedding and the keys' prefix, checked once each.
@pytest.mark.parametrize(("kind", "scan_layers"), [
    ("gemma4", True), ("gemma4", False), ("gemma4_moe", True), ("gemma4_moe", False), ("gemma4_ple", True),
    ("gemma4_ple", False), ("gemma4_untied", False), ("gemma4_multimodal", True),
])  # fmt: skip
def test_export_round_trip_is_bit_exact(tiny_checkpoints, tmp_path, kind, scan_layers):
    src, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=_mesh(kind), scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out", kept=lambda key: "vision" not in key)


def test_per_layer_config_of_resaved_configs_is_read(tiny_checkpoints):
    """transformers 5.24 writes the full layers' shape as ``per_layer_config``, the published configs as
    ``global_head_dim`` / ``num_global_key_value_heads``: both give the same config."""
    saved = json.loads((tiny_checkpoints("gemma4")[0] / "config.json").read_text())
    assert "per_layer_config" in saved and "global_head_dim" not in saved
    published = {k: v for k, v in saved.items() if k != "per_layer_config"}
    published.update(global_head_dim=32, num_global_key_value_heads=1)
    assert Gemma4Config.from_hf(saved) == Gemma4Config.from_hf(published)
    assert (Gemma4Config.from_hf(saved).global_head_dim, Gemma4Config.from_hf(saved).num_global_key_value_heads) == (
        32, 1)


def _real_config() -> dict:
    return json.loads(GEMMA4_26B.read_text())


def _replica_tensors(text: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """The text model's tensors of a Gemma 4 MoE checkpoint (names and shapes as transformers
    stores them, bf16), from its config."""
    cfg = Gemma4Config.from_hf(text)
    h, n, e, m = cfg.hidden_size, cfg.num_attention_heads, cfg.num_experts, cfg.moe_intermediate_size
    p = "model.language_model"
    out = [(f"{p}.embed_tokens.weight", (cfg.vocab_size, h)), (f"{p}.norm.weight", (h,))]
    for i, t in enumerate(cfg.layer_types):
        full = t == F
        d, kv = (cfg.global_head_dim, cfg.num_global_key_value_heads) if full else (cfg.head_dim,
                                                                                    cfg.num_key_value_heads)
        a, layer = f"{p}.layers.{i}.self_attn", f"{p}.layers.{i}"
        out += [(f"{a}.q_proj.weight", (n * d, h)), (f"{a}.k_proj.weight", (kv * d, h)),
                (f"{a}.o_proj.weight", (h, n * d)), (f"{a}.q_norm.weight", (d,)), (f"{a}.k_norm.weight", (d,))]
        if not (full and cfg.attention_k_eq_v):
            out.append((f"{a}.v_proj.weight", (kv * d, h)))
        out += [(f"{layer}.mlp.{k}_proj.weight", s) for k, s in
                (("gate", (cfg.intermediate_size, h)), ("up", (cfg.intermediate_size, h)),
                 ("down", (h, cfg.intermediate_size)))]
        out += [(f"{layer}.{k}.weight", (h,)) for k in
                ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm", "post_feedforward_layernorm_1", "pre_feedforward_layernorm_2",
                 "post_feedforward_layernorm_2")]
        out += [(f"{layer}.layer_scalar", (1,)), (f"{layer}.router.proj.weight", (e, h)),
                (f"{layer}.router.scale", (h,)), (f"{layer}.router.per_expert_scale", (e,)),
                (f"{layer}.experts.gate_up_proj", (e, 2 * m, h)), (f"{layer}.experts.down_proj", (e, h, m))]
    out.append(("model.vision_tower.encoder.layers.0.mlp.up_proj.linear.weight", (4304, 1152)))
    return [(name, "BF16", shape) for name, shape in out]


# Run in a process of 256 simulated devices: the plan timed alone (and the process's peak memory),
# then ``otfload inspect`` as process 0 of 32 (8 devices each) in the same process.
PLAN_256 = """
import json, sys, time
import jax
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 256)
import otfload
from otfload.cli import main
from otfload.place.report import peak_rss
from otfload.plan.sharding import make_mesh
start = time.perf_counter()
_, plan, src = otfload.plan_model(sys.argv[1], mesh=make_mesh({"fsdp": 32, "ep": 8}), scan_layers=True)
seconds = time.perf_counter() - start
src.close()
print(json.dumps({"seconds": seconds, "peak": peak_rss()}))
sys.exit(main(["inspect", sys.argv[1], "--mesh", "fsdp=32,ep=8", "--process-count", "32", "--process-index", "0",
               "--json"]))
"""


@pytest.mark.skipif(not GEMMA4_26B.is_file(), reason="../shared/realconfigs is not checked out")
def test_the_published_26b_a4b_config_plans_at_256_devices(tmp_path):
    """A sparse replica of gemma-4-26B-A4B from its published config (real names, dtypes and shapes,
    holes for the data; scripts/make_replica.py's shard writer) plans on 256 devices (experts on
    ``ep``) from headers alone in under 10 s and 1 GiB, and process 0 of 32 reads no more than its
    devices' share of the bytes."""
    real = _real_config()
    tensors = _replica_tensors(real["text_config"])
    write_replica(tmp_path, tensors, real)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    out = subprocess.run([sys.executable, "-c", PLAN_256, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**env, "TQDM_DISABLE": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    first, rest = out.stdout.split("\n", 1)
    timing, info = json.loads(first), json.loads(rest)
    # the peak is the whole process's: JAX's runtime with 256 CPU devices included (~1.1-1.4 GB in the suite)
    assert timing["seconds"] <= 10 and timing["peak"] <= 2 << 30, timing
    assert info["model_type"] == "gemma4" and info["unused"] == [tensors[-1][0]]  # the vision tower
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    assert leaves["full_layers.moe.gate.kernel"]["shape"] == [5, 128, 704, 2816]
    assert leaves["sliding_layers.attn.q.kernel"]["shape"] == [25, 16, 256, 2816]
    assert leaves["full_layers.attn.k.kernel"]["shape"] == [5, 2, 512, 2816]
    assert "full_layers.attn.v.kernel" not in leaves  # keys are the values
    totals = info["totals"]
    assert 48e9 < totals["source_bytes"] < 54e9
    assert totals["process_bytes"] <= 1.1 * totals["ideal_bytes"], totals


def test_the_last_layer_is_full_as_transformers_makes_it():
    text = {**TEXT, "model_type": "gemma4_text"}
    assert Gemma4Config.from_hf({**text, "layer_types": [S, F, S, S, S, S]}).full_layers == (1, 5)
    assert Gemma4Config.from_hf({**text, "layer_types": None, "num_hidden_layers": 8}).full_layers == (5, 7)


@pytest.mark.skipif(not GEMMA4_26B.is_file(), reason="../shared/realconfigs is not checked out")
def test_the_published_config_parses():
    cfg = Gemma4Config.from_hf(_real_config()["text_config"])
    assert (cfg.global_head_dim, cfg.num_global_key_value_heads, cfg.num_experts, cfg.top_k_experts) == (512, 2, 128, 8)
    assert cfg.full_layers == (5, 11, 17, 23, 29) and cfg.rope_full == (1e6, 0.25, 1.0)
    assert cfg.final_softcap == 30.0 and cfg.tie_word_embeddings and cfg.hidden_size_per_layer_input == 0


@pytest.mark.parametrize(("field", "value"), [
    ("layer_types", [S, "chunked_attention"] * 3),
    ("rope_parameters", {F: {"rope_type": "yarn", "factor": 2.0}, S: {"rope_type": "default"}}),
    ("use_bidirectional_attention", "all"),
    ("attention_bias", True),
    ("hidden_activation", "relu"),
    ("num_kv_shared_layers", 5),
    ("per_layer_config", {"2": {"head_dim": 32}}),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**TEXT, "model_type": "gemma4_text", field: value}
    with pytest.raises(ConfigError) as err:
        Gemma4Config.from_hf(json.loads(json.dumps(config)))
    assert field in err.value.field


# One scan value per kind (the model has no scan-specific gradient code; both values' forwards are
# checked above): scanned on Gemma 4 and its MoE, unscanned on PLE.
@pytest.mark.parametrize(("kind", "scan_layers"), [("gemma4", True), ("gemma4_moe", True), ("gemma4_ple", False)])
def test_gradients_equal_torch_autograd(tiny_checkpoints, tmp_path, kind, scan_layers):
    """tests/training/test_gradients.py's check on Gemma 4: one AdamW step's gradients equal PyTorch
    autograd's per tensor (the pad id's rows of both embeddings frozen); ``layer_scalar``, a buffer
    in transformers, gets none on either side."""
    import copy

    from tests.training.test_gradients import GRAD_TOL, PAD, adamw_step, exported_grads, torch_loss_and_grads

    _, path, ids, loss, grads, _ = adamw_step(tiny_checkpoints, tmp_path, kind, _mesh(kind), scan_layers,
                                              loss_after=False)  # fmt: skip
    torch_model = copy.deepcopy(tiny_checkpoints(kind)[1])
    if kind == "gemma4_ple":
        torch_model.model.embed_tokens_per_layer.padding_idx = PAD
    ref_loss, ref = torch_loss_and_grads(torch_model, ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    ours = exported_grads(grads, path, tmp_path / "grads")
    assert set(ours) == set(ref), set(ours) ^ set(ref)
    for key, grad in ours.items():
        if key.endswith("layer_scalar"):
            assert not np.any(grad) and not np.any(ref[key]), key
            continue
        assert np.abs(ref[key]).max() > 0, key
        assert max_rel_diff(grad, ref[key]) <= GRAD_TOL, (key, max_rel_diff(grad, ref[key]))


@pytest.mark.parametrize(("kind", "merge"), [("gemma4", True), ("gemma4", False), ("gemma4_ple", True),
                                          ("gemma4_moe", True)])
def test_peft_lora_adapter_matches_peft(tiny_checkpoints, tmp_path, kind, merge):
    """A PEFT LoRA adapter on every projection (full layers have no ``v_proj``; shared layers no k/v)
    and, on the MoE model, on the fused experts as stored (``experts.gate_up_proj`` / ``down_proj``,
    ``[E, out, in]`` as transformers keeps them in memory), merged on the fly or kept as factors:
    logits equal ``peft.PeftModel``'s."""
    from tests.adapters.support import ALL_PROJECTIONS, make_adapter, peft_logits

    path, torch_model = tiny_checkpoints(kind)
    experts = ["experts.gate_up_proj", "experts.down_proj"] if kind == "gemma4_moe" else []
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS,
                           target_parameters=experts)
    adapted = hf_tensors(adapter)
    assert any(".experts." in k for k in adapted) == bool(experts)
    ids = token_ids(seq=12)
    reference = peft_logits(torch_model, [adapter], ids)
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > 1e-3  # the adapter matters
    mesh = _mesh(kind)
    model = otfload.from_pretrained(path, adapter=adapter, merge_adapter=merge, mesh=mesh)
    with jax.set_mesh(mesh):
        assert max_rel_diff(logits(model, ids), reference) <= 1e-4


def test_kv_projections_stored_for_shared_layers_are_ignored(tiny_checkpoints, tmp_path, mesh_2x4):
    """A checkpoint that still holds key/value projections and norms for its KV-shared layers (which
    transformers ignores on load) loads under ``strict`` and reads none of them; any other extra
    tensor is still unexpected."""
    import shutil

    from otfload.errors import CheckpointMismatchError
    from tests.helpers import rename_tensors

    src, torch_model = tiny_checkpoints("gemma4_ple")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    a = "model.layers.3.self_attn"  # shared (sliding): reuses layer 2's keys and values
    extra = {f"{a}.k_proj.weight": np.ones((32, 64), np.float32), f"{a}.v_proj.weight": np.ones((32, 64), np.float32),
             f"{a}.k_norm.weight": np.ones((16,), np.float32)}
    rename_tensors(path, lambda k: k, extra)
    model, report = otfload.from_pretrained(path, mesh=mesh_2x4, strict=True, return_report=True)
    assert report.unused_tensors == []
    ids = token_ids(seq=12)
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4
    rename_tensors(path, lambda k: k, {"model.layers.2.self_attn.v_norm.weight": np.ones((16,), np.float32)})
    with pytest.raises(CheckpointMismatchError, match="v_norm"):
        otfload.from_pretrained(path, mesh=mesh_2x4, strict=True)


@pytest.mark.parametrize("kind", ["gemma4", "gemma4_ple"])
def test_padded_batches_match_transformers(tiny_checkpoints, mesh_2x4, kind):
    """Left and right padding: every real token's logits equal transformers' with the same mask."""
    from tests.models.kinds import torch_masked_logits

    path, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    run = jax.jit(lambda m, ids, mask: m(ids, attention_mask=mask))
    for side in ("left", "right"):
        ids, mask, _ = padded_batch(side)
        real = mask.astype(bool)
        with jax.set_mesh(mesh_2x4):
            ours = np.asarray(run(model, ids, mask))
        assert max_rel_diff(ours[real], torch_masked_logits(torch_model, ids, mask)[real]) <= 1e-4, side
