"""Llama 4: tiny transformers checkpoints → otfload → logits and greedy ids equal transformers', the
export round trip bit-exact, the published Scout config planned at 256 devices, and the config
fields otfload does not implement refused by name.

The tiny model keeps every feature live: 4 layers, MoE on every other one (dense MLPs of another
width between), 8 fused experts with top-2 sigmoid routing scaling their input, a shared expert;
RoPE on layers 0-1 (interleaved pairs, weightless q/k norm, chunks of 4 slots on 12-token inputs)
and NoPE on layers 2-3 with attention-temperature tuning (``floor_scale`` 4, so it bites). The
variant has every layer MoE, top-1, no q/k norm, no temperature, no chunking and tied embeddings;
the multimodal wrapper's text model is loaded with its vision tower never read."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import otfload
from otfload.errors import ConfigError
from otfload.families.llama4.config import Llama4Config
from otfload.plan.sharding import make_mesh
from tests.families.checks import (
    MESHES,
    assert_export_round_trip,
    assert_greedy_matches,
    expert_parallel_diff,
    load_sharded,
    write_replica,
)
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, register_hf_model, token_ids, torch_logits

REALCONFIGS = Path(__file__).resolve().parents[3] / "shared" / "realconfigs"
SCOUT = REALCONFIGS / "meta-llama__Llama-4-Scout-17B-16E-Instruct.json"
TEXT = dict(vocab_size=256, hidden_size=64, intermediate_size=32, intermediate_size_mlp=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
            interleave_moe_layer_step=2, no_rope_layers=[1, 1, 0, 0], attention_chunk_size=4, floor_scale=4,
            max_position_embeddings=128)
PLAIN = {"interleave_moe_layer_step": 1, "num_experts_per_tok": 1, "use_qk_norm": False,
         "attn_temperature_tuning": False, "attention_chunk_size": None, "tie_word_embeddings": True,
         "no_rope_layers": [1, 0, 1, 0]}
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14, vision_output_dim=64, projector_input_dim=64, projector_output_dim=64)


def _llama4(**kw):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    return Llama4ForCausalLM(Llama4TextConfig(**{**TEXT, **kw}))


def _llama4_multimodal(**kw):
    from transformers import Llama4Config as HfLlama4Config
    from transformers import Llama4ForConditionalGeneration

    return Llama4ForConditionalGeneration(HfLlama4Config(text_config={**TEXT, **kw}, vision_config=VISION))


register_hf_model("llama4", _llama4)
register_hf_model("llama4_plain", _llama4, PLAIN)
register_hf_model("llama4_multimodal", _llama4_multimodal)


# The multimodal wrapper (only its keys' prefix differs) once; unscanned on tp is llama4_plain's.
@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), [
    ("llama4", False, "fsdp2_ep4"), ("llama4", True, "fsdp2_tp4"), ("llama4", True, "fsdp2_ep4"),
    ("llama4_plain", True, "fsdp2_ep4"), ("llama4_plain", False, "fsdp2_tp4"),
    ("llama4_multimodal", True, "fsdp2_ep4"),
])  # fmt: skip
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    loaded, torch_model, mesh = load_sharded(tiny_checkpoints, kind, mesh_name, scan_layers, return_report=True)
    model, report = loaded
    if kind == "llama4_multimodal":  # the vision tower and projector: listed, never read
        assert report.unused_tensors and all(k.startswith(("vision_model.", "multi_modal_projector."))
                                             for k in report.unused_tensors)
    else:
        assert report.unused_tensors == []
    moe = model.moe_layers if scan_layers else model.moe_layers[0]
    if scan_layers and kind != "llama4_plain":  # dense and MoE layers: two stacks
        assert model.dense_layers.mlp.gate.kernel[...].shape == (2, 128, 64)
        assert model.moe_layers.moe.gate.kernel[...].shape == (2, 8, 64, 32)
    if kind == "llama4_multimodal":  # transformers 5.24's wrapper forward fails on text alone: its text model
        torch_model = torch_model.language_model
    diff = expert_parallel_diff(model, torch_model, mesh, moe.moe.gate.kernel[...], scan_layers)
    assert diff <= 1e-4, diff


def test_chunks_temperature_and_qk_norm_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: no chunking, no temperature tuning or no q/k norm move the
    logits past twice its tolerance."""
    import dataclasses

    path, torch_model = tiny_checkpoints("llama4")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    cfg, diffs = model.cfg, []
    for changed in (dataclasses.replace(cfg, attention_chunk_size=None),
                    dataclasses.replace(cfg, attn_temperature_tuning=False),
                    dataclasses.replace(cfg, use_qk_norm=False)):
        model.cfg = changed
        diffs.append(max_rel_diff(logits(model, ids), ref))
    model.cfg = cfg
    assert min(diffs) > 2e-4, diffs


def test_long_inputs_match_transformers(tiny_checkpoints, mesh_2x4):
    """530 tokens: the attention runs in query chunks (``Q_CHUNK`` 512), each masked to its
    ``attention_chunk_size`` chunks of keys; memory stays linear in the sequence."""
    from otfload.models.attention import Q_CHUNK

    path, torch_model = tiny_checkpoints("llama4")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(batch=1, seq=Q_CHUNK + 18)
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4


@pytest.mark.parametrize("scan_layers", [True, False])
def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh_2x4, scan_layers):
    """Left-padded prompts decoded past chunk boundaries (chunks of 4 slots)."""
    path, torch_model = tiny_checkpoints("llama4")
    assert_greedy_matches(otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers), torch_model)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", ["llama4", "llama4_plain"])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, kind, scan_layers):
    src, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out")


def _fbgemm_fp8(key: str, w):
    """FP8 e4m3 codes as the ``fbgemm_fp8`` release stores them: a scale per row of a ``[out, in]``
    weight (``weight_scale [out, 1]``), per expert and output column of a fused ``[E, in, out]`` one
    (``gate_up_proj_scale [E, 1, out]``, ``down_proj_scale [E, out, 1]``); returns the stored tensors and
    the dequantised reference."""
    import torch

    from tests.index.quant.layouts import FP8_MAX

    axis = 1 if w.ndim == 3 else -1
    scale = (w.abs().amax(axis, keepdim=True) / FP8_MAX).clamp_min(1e-12)
    codes = (w / scale).to(torch.float8_e4m3fn)
    stored = scale.transpose(1, 2) if key.endswith("down_proj") else scale
    return {key: codes, f"{key}_scale": stored}, codes.float() * scale


def _is_fp8_in_release(key: str) -> bool:
    """The feed-forward weights (dense MLPs, shared and routed experts); attention and router kept."""
    return ".feed_forward." in key and ".router." not in key


def test_fbgemm_fp8_experts_match_transformers_on_the_dequantised_weights(tiny_checkpoints, mesh_2x4, tmp_path):
    """The FP8 layout of Llama 4's ``fbgemm_fp8`` release (Maverick): fused experts FP8 with a scale
    per expert and output column, dense and shared-expert MLPs per row; logits equal transformers' on
    the dequantised weights, the experts kept packed on the devices on request."""
    from tests.index.quant import layouts

    src, torch_model = tiny_checkpoints("llama4")
    qc = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
          "modules_to_not_convert": ["self_attn", "router", "lm_head"]}
    dst = tmp_path / "ckpt"
    reference = layouts.quantize_checkpoint(src, dst, _is_fp8_in_release, _fbgemm_fp8, qc)
    assert len(reference) == 2 * 3 + 2 * (2 + 3)  # 2 dense MLPs x 3, 2 MoE layers x (2 fused + 3 shared)
    reference_model = layouts.load_reference(torch_model, reference, src, tmp_path / "reference")
    ids = token_ids(seq=12)
    ref = torch_logits(reference_model, ids)
    for quantized in ("dequantize", "keep"):
        model = otfload.from_pretrained(dst, mesh=mesh_2x4, dtype="float32", quantized=quantized)
        kept = type(model.moe_layers.moe.gate.kernel[...]).__name__ == "QuantizedArray"
        assert kept == (quantized == "keep")
        assert max_rel_diff(logits(model, ids), ref) <= 1e-4


@pytest.mark.parametrize("scan_layers", [True, False])
def test_peft_lora_merges_like_peft(tiny_checkpoints, tmp_path, scan_layers):
    """A PEFT adapter on the attention, the shared expert and the fused routed experts merges on the
    fly: logits equal ``PeftModel``'s, and the adapter moves them well past the bound; without the
    experts it is also kept as factors (``merge_adapter=False``), logits again ``PeftModel``'s. (PEFT reads
    Llama 4's fused parameters, which carry no ``is_transposed``, in their stored axis order, so the
    family keeps the default expert layout.)"""
    from tests.adapters.support import kept_factors, make_adapter, peft_logits

    path, torch_model = tiny_checkpoints("llama4")
    modules, mesh = ["q_proj", "v_proj", "shared_expert.up_proj"], make_mesh(MESHES["fsdp2_ep4"])
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=modules,
                           target_parameters=["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"])
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh, scan_layers=scan_layers)
    assert max_rel_diff(logits(model, ids), reference) <= 1e-4
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > 1e-3
    # kept as factors: the fused experts' factors (target_parameters) merge only, so they are left out;
    # checked scanned only: factors are stacked or per layer by the same generic code for every family
    # (tests/adapters/test_factored.py checks both scan values), and merged is checked in both here
    if scan_layers:
        kept_adapter = make_adapter(torch_model, tmp_path / "kept", r=2, lora_alpha=4, target_modules=modules)
        kept = otfload.from_pretrained(path, adapter=kept_adapter, merge_adapter=False, mesh=mesh, scan_layers=True)
        assert kept_factors(kept)
        assert max_rel_diff(logits(kept, ids), peft_logits(torch_model, [kept_adapter], ids)) <= 1e-4


def _real_config() -> dict:
    return json.loads(SCOUT.read_text())


def _replica_tensors(text: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """The names, dtypes and shapes of Scout's text model (as Llama4ForConditionalGeneration stores
    it) plus one vision tensor."""
    h, v, e, m = text["hidden_size"], text["vocab_size"], text["num_local_experts"], text["intermediate_size"]
    n, kv, d = text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]
    out = [("language_model.model.embed_tokens.weight", (v, h)), ("language_model.model.norm.weight", (h,)),
           ("language_model.lm_head.weight", (v, h))]
    for i in range(text["num_hidden_layers"]):
        layer = f"language_model.model.layers.{i}"
        ff = f"{layer}.feed_forward"
        out += [(f"{layer}.input_layernorm.weight", (h,)), (f"{layer}.post_attention_layernorm.weight", (h,)),
                (f"{layer}.self_attn.q_proj.weight", (n * d, h)), (f"{layer}.self_attn.k_proj.weight", (kv * d, h)),
                (f"{layer}.self_attn.v_proj.weight", (kv * d, h)), (f"{layer}.self_attn.o_proj.weight", (h, n * d)),
                (f"{ff}.router.weight", (e, h)), (f"{ff}.experts.gate_up_proj", (e, h, 2 * m)),
                (f"{ff}.experts.down_proj", (e, m, h)),
                *((f"{ff}.shared_expert.{p}_proj.weight", (m, h)) for p in ("gate", "up")),
                (f"{ff}.shared_expert.down_proj.weight", (h, m))]
    out.append(("vision_model.patch_embedding.linear.weight", (1408, 588)))
    return [(name, "BF16", shape) for name, shape in out]


@pytest.mark.skipif(not SCOUT.is_file(), reason="../shared/realconfigs is not checked out")
def test_the_published_scout_config_plans_at_256_devices(tmp_path):
    """A sparse replica of Llama-4-Scout-17B-16E from its published config (real names, dtypes and
    shapes, holes for the data) plans on 256 devices (``otfload inspect --devices 256``, experts on
    ``ep``) from headers alone in under 10 s."""
    real = _real_config()
    tensors = _replica_tensors(real["text_config"])
    write_replica(tmp_path, tensors, real)
    otfload_bin = Path(sys.executable).parent / "otfload"
    out = subprocess.run([str(otfload_bin), "inspect", str(tmp_path), "--devices", "256", "--mesh",
                          "fsdp=16,ep=16", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout)
    assert info["model_type"] == "llama4" and info["unused"] == [tensors[-1][0]]
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    assert leaves["moe_layers.moe.gate.kernel"]["shape"] == [48, 16, 5120, 8192]
    assert leaves["moe_layers.attn.q.kernel"]["shape"] == [48, 40, 128, 5120]
    assert not any(leaf.startswith("dense_layers.") for leaf in leaves)
    assert 200e9 < info["totals"]["source_bytes"] < 230e9
    assert info["seconds"] <= 10 if "seconds" in info else True


@pytest.mark.skipif(not SCOUT.is_file(), reason="../shared/realconfigs is not checked out")
def test_the_published_config_parses():
    cfg = Llama4Config.from_hf(_real_config()["text_config"])
    assert cfg.moe_layers == tuple(range(48)) and cfg.dense_layers == ()
    assert cfg.use_rope[:4] == (True, True, True, False) and cfg.chunked == cfg.use_rope
    assert (cfg.attention_chunk_size, cfg.rope_theta, cfg.rope_scaling["rope_type"]) == (8192, 5e5, "llama3")


@pytest.mark.parametrize(("field", "value"), [
    ("hidden_act", "gelu"),
    ("layer_types", ["sliding_attention"] * 4),
    ("no_rope_layers", [1, 0]),
    ("moe_layers", [1, 7]),
    ("num_experts_per_tok", 9),
    ("rope_parameters", {"rope_type": "longrope"}),
])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**TEXT, "model_type": "llama4_text", field: value}
    with pytest.raises(ConfigError) as err:
        Llama4Config.from_hf(json.loads(json.dumps(config)))
    assert field in err.value.field
