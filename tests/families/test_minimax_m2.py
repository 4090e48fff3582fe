"""MiniMax-M2 (``minimax_m2``): tiny transformers checkpoints → otfload → logits and greedy ids equal
transformers', the export round trip bit-exact, and the published MiniMax-M2.5 ``config.json``
(read from ``../shared/realconfigs``, never copied) on a tiny FP8 block-scaled checkpoint.

The tiny models keep every feature live: 8 routed experts, top 2 by sigmoid score plus a random
correction bias, q/k norms over the whole projections, half of each head rotated; the variant has
tied embeddings, as many kv heads as heads and a quarter of each head rotated."""

import json
from pathlib import Path

import jax
import pytest

import otfload
from otfload.errors import ConfigError
from otfload.families.minimax_m2.config import MiniMaxM2Config
from otfload.plan.sharding import make_mesh
from tests.families.checks import (
    MESHES,
    assert_export_round_trip,
    assert_greedy_matches,
    expert_parallel_diff,
    load_sharded,
)
from tests.families.test_deepseek import _randomize_router_bias
from tests.helpers import BASE, max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.helpers import jax_logits as logits
from tests.index.quant import layouts

REALCONFIGS = Path(__file__).resolve().parents[3] / "shared" / "realconfigs"
MINIMAX_M25 = REALCONFIGS / "MiniMaxAI__MiniMax-M2.5.json"
MINIMAX_BASE = {**BASE, "head_dim": 32, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                "rotary_dim": 16}


def _minimax_m2(**kw):
    from transformers import MiniMaxM2Config as HfMiniMaxM2Config
    from transformers import MiniMaxM2ForCausalLM

    model = MiniMaxM2ForCausalLM(HfMiniMaxM2Config(**{**MINIMAX_BASE, **kw}))
    _randomize_router_bias(model)
    return model


register_hf_model("minimax_m2", _minimax_m2)
register_hf_model("minimax_m2_tied", _minimax_m2, {"tie_word_embeddings": True, "num_key_value_heads": 4,
                                                   "rotary_dim": 8})


@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), [
    ("minimax_m2", False, "fsdp2_ep4"), ("minimax_m2", True, "fsdp2_tp4"), ("minimax_m2_tied", True, "fsdp2_ep4"),
])  # fmt: skip
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    model, torch_model, mesh = load_sharded(tiny_checkpoints, kind, mesh_name, scan_layers)
    layer = model.layers if scan_layers else model.layers[0]
    assert layer.attn.q_norm.scale[...].shape == ((3,) if scan_layers else ()) + (4, 32)  # over every head
    diff = expert_parallel_diff(model, torch_model, mesh, layer.moe.experts.gate.kernel[...], scan_layers)
    assert diff <= 1e-4, diff


def test_partial_rotary_and_correction_bias_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: full rotary, or routing without the correction bias, moves
    the logits past several times the parity bound."""
    import dataclasses

    path, torch_model = tiny_checkpoints("minimax_m2")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    cfg = model.cfg
    model.cfg = dataclasses.replace(cfg, rotary_dim=cfg.head_dim)
    assert max_rel_diff(logits(model, ids), ref) > 5e-4
    model.cfg = cfg
    bias = model.layers.moe.router.bias
    kept = bias[...]
    bias[...] = jax.numpy.zeros_like(kept)
    assert max_rel_diff(logits(model, ids), ref) > 5e-4
    bias[...] = kept


def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh_2x4):
    """Scanned: the cache is the generic one of every family, checked unscanned by other families' tests."""
    path, torch_model = tiny_checkpoints("minimax_m2")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    assert_greedy_matches(model, torch_model, no_eos=True)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", ["minimax_m2", "minimax_m2_tied"])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, kind, scan_layers):
    src, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out")


@pytest.mark.parametrize(("field", "value"), [("use_qk_norm", False), ("qk_norm_type", "per_head"),
                                              ("scoring_func", "softmax"), ("use_routing_bias", False),
                                              ("shared_intermediate_size", 512), ("rotary_dim", 7),
                                              ("hidden_act", "gelu")])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**MINIMAX_BASE, "model_type": "minimax_m2", field: value}
    with pytest.raises(ConfigError) as err:
        MiniMaxM2Config.from_hf(config)
    assert field in err.value.field


@pytest.mark.skipif(not MINIMAX_M25.is_file(), reason="../shared/realconfigs is not checked out")
def test_published_config_with_fp8_blocks_matches_transformers(tiny_checkpoints, mesh_2x4, tmp_path):
    """MiniMax-M2.5's own config.json (its MTP, routing and qk-norm fields and its FP8
    ``quantization_config`` verbatim; sizes from the tiny model): the attention and expert weights
    FP8 with a float32 scale per 128 x 128 block, the router and lm_head kept (``modules_to_not_convert``);
    logits equal transformers' on the dequantised weights."""
    real = json.loads(MINIMAX_M25.read_text())
    src, torch_model = tiny_checkpoints("minimax_m2")
    qc = real["quantization_config"]
    assert (qc["quant_method"], qc["weight_block_size"]) == ("fp8", [128, 128])
    dst = tmp_path / "ckpt"
    reference = layouts.quantize_checkpoint(src, dst, layouts.is_linear, layouts.fp8_blocks((128, 128)), qc)
    assert len(reference) == 3 * (4 + 8 * 3)  # 3 layers x (q, k, v, o + 8 experts x w1, w2, w3)
    tiny = json.loads((dst / "config.json").read_text())
    sizes = {k: v for k, v in tiny.items() if k not in ("rope_parameters", "architectures", "transformers_version")}
    config = {**real, **sizes, "rotary_dim": 16, "quantization_config": qc}
    (dst / "config.json").write_text(json.dumps(config))
    reference_model = layouts.load_reference(torch_model, reference, src, tmp_path / "reference")
    model = otfload.from_pretrained(dst, mesh=mesh_2x4, dtype="float32")
    ids = token_ids(seq=12)
    assert max_rel_diff(logits(model, ids), torch_logits(reference_model, ids)) <= 1e-4


def minimax_m25_headers(path: Path) -> Path:
    """MiniMax-M2.5 at full size, headers only: its published config and every tensor its FP8 release
    stores (attention and experts FP8 with 128 x 128 block scales; norms, router, embeddings bf16; the
    correction bias float32), one file per layer."""
    from tests.realsize import fp8_linear, write_header_checkpoint

    cfg = json.loads(MINIMAX_M25.read_text())
    h, n, kv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    m, e, layers = cfg["intermediate_size"], cfg["num_local_experts"], cfg["num_hidden_layers"]
    shards = {}
    for i in range(layers):
        p, moe = f"model.layers.{i}", f"model.layers.{i}.block_sparse_moe"
        t = {f"{p}.input_layernorm.weight": ("BF16", (h,)), f"{p}.post_attention_layernorm.weight": ("BF16", (h,)),
             f"{p}.self_attn.q_norm.weight": ("BF16", (n * d,)), f"{p}.self_attn.k_norm.weight": ("BF16", (kv * d,)),
             f"{moe}.gate.weight": ("BF16", (e, h)), f"{moe}.e_score_correction_bias": ("F32", (e,))}
        for name, out, inp in (("q", n * d, h), ("k", kv * d, h), ("v", kv * d, h), ("o", h, n * d)):
            t |= fp8_linear(f"{p}.self_attn.{name}_proj.weight", out, inp)
        for x in range(e):
            for name, out, inp in (("w1", m, h), ("w3", m, h), ("w2", h, m)):
                t |= fp8_linear(f"{moe}.experts.{x}.{name}.weight", out, inp)
        shards[f"model-{i + 1:05d}-of-{layers + 1:05d}.safetensors"] = t
    shards[f"model-{layers + 1:05d}-of-{layers + 1:05d}.safetensors"] = {
        "model.embed_tokens.weight": ("BF16", (cfg["vocab_size"], h)), "model.norm.weight": ("BF16", (h,)),
        "lm_head.weight": ("BF16", (cfg["vocab_size"], h))}
    return write_header_checkpoint(path, shards, cfg)


@pytest.mark.skipif(not MINIMAX_M25.is_file(), reason="../shared/realconfigs is not checked out")
def test_published_minimax_m25_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` of the full-size MiniMax-M2.5 (62 layers x 256 experts, FP8
    blocks as published; 95k stored tensors, 48k of them weights): every leaf planned, experts on ``ep``, within 10 s of
    CPU (the process's own time: wall time on a shared test machine measures the neighbours) and
    1 GiB, and one process's bytes within 1.1 x its devices' share of the checkpoint."""
    import os
    import resource
    import subprocess
    import sys

    path = minimax_m25_headers(tmp_path / "minimax_m25")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    # the child reports its own peak (its address space's: ru_maxrss would carry this worker's over the exec)
    probe = ("import sys\nfrom otfload.cli import main\nfrom otfload.place.report import peak_rss\ntry:\n"
             "    code = main(sys.argv[1:])\nfinally:\n    sys.stderr.write(f'PEAK {peak_rss()}\\n')\nsys.exit(code)")
    run = subprocess.run([sys.executable, "-c", probe, "inspect", str(path), "--devices", "256",
                          "--mesh", "fsdp=16,ep=16", "--process-index", "0", "--process-count", "32", "--json"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TQDM_DISABLE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert run.returncode == 0, run.stderr[-2000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    peak = int(run.stderr.rsplit("PEAK ", 1)[1].split()[0])
    assert cpu <= 10 and peak <= 2**30, (cpu, peak)
    info = json.loads(run.stdout)
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    experts = leaves["layers.moe.experts.gate.kernel"]
    assert experts["shape"] == [62, 256, 1536, 3072] and "'ep'" in experts["sharding"], experts
    assert experts["storage"].startswith("fp8"), experts["storage"]
    totals = info["totals"]
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)


def test_peft_lora_merges_like_peft(tiny_checkpoints, tmp_path):
    """A PEFT adapter on the attention and the fused routed experts (transformers' runtime names,
    mapped to the stored ``block_sparse_moe.experts.{e}.w1/w3/w2``) merges on the fly: logits equal
    ``PeftModel``'s, and the adapter moves them well past the bound; without the routed experts it is
    also kept as factors (``merge_adapter=False``), logits again ``PeftModel``'s. Scanned: the merge
    works on the checkpoint's index, before any stacking, and factors are stacked or per layer by the
    generic code tests/adapters/test_factored.py checks with both scan values."""
    from tests.adapters.support import DOWN, GATE_UP, kept_factors, make_adapter, peft_logits

    path, torch_model = tiny_checkpoints("minimax_m2")
    modules, mesh = ["q_proj", "v_proj"], make_mesh(MESHES["fsdp2_ep4"])
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=modules,
                           target_parameters=[GATE_UP, DOWN])
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh, scan_layers=True)
    assert max_rel_diff(logits(model, ids), reference) <= 1e-4
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > 1e-3
    # kept as factors: the fused experts' factors (target_parameters) merge only, so they are left out
    kept_adapter = make_adapter(torch_model, tmp_path / "kept", r=2, lora_alpha=4, target_modules=modules)
    kept = otfload.from_pretrained(path, adapter=kept_adapter, merge_adapter=False, mesh=mesh, scan_layers=True)
    assert kept_factors(kept)
    assert max_rel_diff(logits(kept, ids), peft_logits(torch_model, [kept_adapter], ids)) <= 1e-4
