"""DeepSeek-V3.2 (``deepseek_v32``) and GLM-5 (``glm_moe_dsa``): tiny transformers checkpoints →
otfload → logits, greedy ids, gradients and LoRA-merged logits equal transformers' (and PEFT's), on
both sides of the indexer's top-k rule; the export round trip bit-exact.

The tiny models are DeepSeek-V3's (tests/families/test_deepseek.py: one dense and two MoE layers,
grouped routing with a correction bias, YaRN) plus the DSA indexer on every layer with
``index_topk = 4``: a 12-token sequence leaves the later queries a choice of 4 among up to 12 (both
sides of the rule in one call), a 3-token one has fewer keys than ``index_topk`` (the top-k rule's
test checks it), 80 tokens run the query chunks of :mod:`otfload.models.sparse_indexer`. 16 indexer
heads make an exact tie of two keys' scores (every head's ReLU zero for both) too rare to meet, so the
selection is the same as torch's.
The published configs (``../shared/realconfigs``, read from there) plan at 256 devices from sparse
replicas (scripts/make_replica.py), DeepSeek-V3.2 in its FP8 block-scaled layout.
"""

import dataclasses
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
from otfload.families.deepseek_v32.config import dsa_config
from otfload.plan.sharding import make_mesh
from tests.families.checks import MESHES, assert_export_round_trip, assert_greedy_matches
from tests.families.test_deepseek import DEEPSEEK_BASE, YARN, _randomize_router_bias
from tests.helpers import hf_tensors, max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.helpers import jax_logits as logits

TOPK = 4
DSA_BASE = {**DEEPSEEK_BASE, "q_lora_rank": 24, "rope_parameters": YARN, "routed_scaling_factor": 2.5,
            "index_topk": TOPK, "index_n_heads": 16, "index_head_dim": 16}
KINDS = ("deepseek_v32", "glm_moe_dsa")
ROOT = Path(__file__).resolve().parents[2]
REALCONFIGS = ROOT.parent / "shared" / "realconfigs"
REAL = {"deepseek_v32": REALCONFIGS / "deepseek-ai__DeepSeek-V3.2.json",
        "glm_moe_dsa": REALCONFIGS / "zai-org__GLM-5.json"}
NEEDS_REAL = pytest.mark.skipif(not all(p.is_file() for p in REAL.values()),
                                reason="../shared/realconfigs is not checked out")


def _dsa(kind: str, **kw):
    import transformers

    names = {"deepseek_v32": "DeepseekV32", "glm_moe_dsa": "GlmMoeDsa"}[kind]
    config = getattr(transformers, f"{names}Config")(**{**DSA_BASE, **kw})
    model = getattr(transformers, f"{names}ForCausalLM")(config)
    _randomize_router_bias(model)
    return model


for _kind in KINDS:
    register_hf_model(_kind, lambda _k=_kind, **kw: _dsa(_k, **kw))


@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), [
    ("deepseek_v32", True, "fsdp2_tp4"), ("deepseek_v32", False, "fsdp2_ep4"),
    ("glm_moe_dsa", True, "fsdp2_ep4"), ("glm_moe_dsa", False, "fsdp2_tp4"),
])  # fmt: skip  (the ep cases' 12-token programs serve the LoRA test's merged logits)
def test_f32_logits_match_transformers_below_and_above_index_topk(tiny_checkpoints, kind, scan_layers, mesh_name):
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    mesh = make_mesh(MESHES[mesh_name])
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers)
    moe = model.moe_layers if scan_layers else model.moe_layers[1]
    assert moe.attn.indexer.q.kernel[...].shape == ((2,) if scan_layers else ()) + (16, 16, 24)
    spec = moe.moe.experts.gate.kernel[...].sharding.spec
    assert spec[1 if scan_layers else 0] == ("ep" if "ep" in MESHES[mesh_name] else None)
    ids = token_ids(seq=12)  # the first 4 queries see every key, the later ones the top 4 of up to 12
    with jax.set_mesh(mesh):
        diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_long_sequences_run_in_query_chunks_and_match(tiny_checkpoints, mesh_2x4):
    from otfload.models.sparse_indexer import Q_CHUNK

    path, torch_model = tiny_checkpoints("deepseek_v32")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=80)
    assert ids.shape[1] > Q_CHUNK
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4


@pytest.mark.parametrize("kind", KINDS)
def test_the_top_k_rule_and_the_indexer_rope_are_live(tiny_checkpoints, mesh_2x4, kind):
    """Attending to every key instead of the top 4 changes the 12-token logits well past the bound
    and leaves the 3-token ones (no more keys than index_topk) unchanged; so does the indexer's RoPE
    layout (interleaved pairs on GLM-5, rotate-half on DeepSeek-V3.2) at 12 tokens."""
    path, torch_model = tiny_checkpoints(kind)
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    base = model.cfg
    short, long = token_ids(seq=3), token_ids(seq=12)
    ref_short, ref_long = torch_logits(torch_model, short), torch_logits(torch_model, long)
    model.cfg = dataclasses.replace(base, index_topk=64)  # more than any sequence here: every key
    assert max_rel_diff(logits(model, long), ref_long) > 1e-3
    assert max_rel_diff(logits(model, short), ref_short) <= 1e-4
    model.cfg = dataclasses.replace(base, indexer_rope_interleave=not base.indexer_rope_interleave)
    assert max_rel_diff(logits(model, long), ref_long) > 1e-3


def test_indexer_leaves_hold_their_tensors(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("glm_moe_dsa")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    hf = hf_tensors(path)
    indexer = model.moe_layers.attn.indexer
    prefix = "model.layers.2.self_attn.indexer"
    np.testing.assert_array_equal(np.asarray(indexer.q.kernel[...])[1], hf[f"{prefix}.wq_b.weight"].reshape(16, 16, 24))
    np.testing.assert_array_equal(np.asarray(indexer.k.kernel[...])[1], hf[f"{prefix}.wk.weight"])
    np.testing.assert_array_equal(np.asarray(indexer.k_norm.bias[...])[1], hf[f"{prefix}.k_norm.bias"])
    np.testing.assert_array_equal(np.asarray(indexer.head_weights.kernel[...])[1], hf[f"{prefix}.weights_proj.weight"])


@pytest.mark.parametrize(("kind", "scan_layers"), [("deepseek_v32", True), ("glm_moe_dsa", False)])
def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh_2x4, kind, scan_layers):
    """Left-padded prompts of up to 8 tokens and 6 new ones: the indexer's keys come from the cache,
    and the later steps choose 4 of more keys."""
    path, torch_model = tiny_checkpoints(kind)
    assert_greedy_matches(otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers), torch_model)


@pytest.mark.parametrize("scan_layers", [True, False])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, scan_layers):
    src, _ = tiny_checkpoints("deepseek_v32")
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out")


# --- configs ------------------------------------------------------------------------------------

TINY = {**{k: v for k, v in DSA_BASE.items() if k != "rope_parameters"}, "rope_theta": 10000.0}


@pytest.mark.parametrize(("change", "field"), [
    ({"indexer_types": ["full", "sliding", "full"]}, "indexer_types[1]"),  # an unknown indexer type
    ({"indexer_types": ["full", "shared", "full"]}, "indexer_types"),  # reuses another layer's top-k
    ({"index_topk_pattern": "FSF"}, "index_topk_pattern"),
    ({"index_topk_pattern": "FXF"}, "index_topk_pattern[1]"),
    ({"index_topk_freq": 2, "index_skip_topk_offset": 1}, "index_topk_freq"),
    ({"layer_types": ["indexed_attention", "full_attention", "indexed_attention"]}, "layer_types[1]"),
    ({"mlp_layer_types": ["sparse", "dense", "sparse"]}, "mlp_layer_types"),
    ({"rope_interleave": False}, "rope_interleave"),
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave"),
    ({"q_lora_rank": None}, "q_lora_rank"),
    ({"index_head_dim": 4}, "index_head_dim"),
])  # fmt: skip
def test_unsupported_indexer_configs_are_typed_errors_naming_the_field(change, field):
    hf = {**TINY, "model_type": "glm_moe_dsa"}
    dsa_config(hf)  # the unchanged config parses
    with pytest.raises(ConfigError) as err:
        dsa_config({**hf, **change})
    assert err.value.field == field and field in str(err.value)


@NEEDS_REAL
@pytest.mark.parametrize("kind", KINDS)
def test_the_published_configs_parse_as_transformers_reads_them(kind):
    from transformers import AutoConfig

    real = json.loads(REAL[kind].read_text())
    cfg = dsa_config(real)
    ref = AutoConfig.for_model(**real)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (ref.index_topk, ref.index_n_heads,
                                                                       ref.index_head_dim)
    assert cfg.indexer_rope_interleave == (kind == "glm_moe_dsa")
    assert cfg.first_k_dense_replace == ref.mlp_layer_types.count("dense") == 3
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.mtp_layers) == (256, ref.n_group, ref.topk_group, 1)


# Plans each (checkpoint, scan_layers) pair of its arguments in turn, timing each one alone: one JSON line each.
PLAN_CHILD = """
import json, sys, time
import jax
jax.devices()
import otfload
from otfload.cli.inspect import process_devices
from otfload.plan.process_bytes import process_counts, process_totals
from otfload.plan.sharding import make_mesh
mesh = make_mesh({"fsdp": 32, "ep": 8})
for path, scan in zip(sys.argv[1::2], sys.argv[2::2]):
    start, cpu = time.perf_counter(), time.process_time()
    _, plan, src = otfload.plan_model(path, mesh=mesh, scan_layers=scan == "1")
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    src.close()
    storage = {k: v.storage for k, v in plan.leaves.items() if k.startswith("moe_layers")}
    needed = process_totals(process_counts(plan, process_devices(mesh, 0, 32)[0]).values()).needed
    print(json.dumps({"wall": wall, "cpu": cpu, "unused": plan.unused, "bytes": plan.source_bytes, "storage": storage,
                      "process_bytes": needed}))
"""


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    from tests.place.test_plan_scale import replica_module

    made = {}
    for kind, name in (("deepseek_v32", "deepseek-v3.2"), ("glm_moe_dsa", "glm-5")):
        made[kind] = tmp_path_factory.mktemp("replica") / name
        replica_module().make_replica(name, made[kind], json.loads(REAL[kind].read_text()))
    return made


# One scan value per kind, as the gradient tests (the planner's scanned and unscanned paths at real size
# are both here; GPT-OSS-120B plans at real size in both in tests/place/test_plan_scale.py).
PLAN_CASES = [("deepseek_v32", True), ("glm_moe_dsa", False)]


@pytest.fixture(scope="module")
def plans(replicas) -> dict:
    """Every case of ``PLAN_CASES`` planned in one process with 256 simulated devices (the device count
    is fixed when JAX starts), each timed alone: ``{(kind, scan_layers): figures}``."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=256", "JAX_PLATFORMS": "cpu"}
    args = [a for kind, scan in PLAN_CASES for a in (str(replicas[kind]), "1" if scan else "0")]
    out = subprocess.run([sys.executable, "-c", PLAN_CHILD, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=600, check=True)  # fmt: skip
    lines = out.stdout.strip().splitlines()[-len(PLAN_CASES) :]
    return {case: json.loads(line) for case, line in zip(PLAN_CASES, lines, strict=True)}


@NEEDS_REAL
@pytest.mark.parametrize(("kind", "scan_layers"), PLAN_CASES)
def test_the_published_configs_plan_at_256_devices(plans, kind, scan_layers):
    """Planned from headers in a process with 256 simulated devices (fsdp=32, ep=8) in at most 10 s
    of the planning process's CPU (its wall time on a shared machine varies with the other jobs):
    DeepSeek-V3.2's FP8 weights with 128x128 scales, GLM-5 in BF16, each MTP layer unused; the stored
    bytes process 0 of 32 needs within 1.1x its 8 devices' share (no leaf whole on every device)."""
    r = plans[kind, scan_layers]
    print(f"{kind} scan_layers={scan_layers}: plan {r['wall']:.2f} s wall, {r['cpu']:.2f} s CPU")
    assert r["cpu"] <= 10, r["cpu"]
    layers = 61 if kind == "deepseek_v32" else 78
    assert r["unused"] and all(k.startswith(f"model.layers.{layers}.") for k in r["unused"])  # the MTP layer
    fp8 = "fp8 float8_e4m3fn, float32 scale per 128x128 block"
    key = "moe_layers.attn.indexer.q.kernel" if scan_layers else "moe_layers.0.attn.indexer.q.kernel"
    experts = key.replace("attn.indexer.q", "moe.experts.up")
    expected = fp8 if kind == "deepseek_v32" else "bfloat16"
    assert r["storage"][key] == r["storage"][experts] == expected
    assert r["storage"][key.replace(".q.", ".head_weights.")] == "bfloat16"
    assert (660e9 if kind == "deepseek_v32" else 1400e9) < r["bytes"] < (700e9 if kind == "deepseek_v32" else 1600e9)
    assert r["process_bytes"] <= 1.1 * r["bytes"] * 8 / 256, r["process_bytes"] * 32 / r["bytes"]


# --- training -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("kind", "scan_layers"), [("deepseek_v32", True), ("glm_moe_dsa", False)])
def test_gradients_equal_torch_autograd(tiny_checkpoints, tmp_path, kind, scan_layers):
    """One AdamW step on the ep mesh: the loss and every gradient as PyTorch's (the indexer's none:
    its top-k choice is not differentiable, and transformers runs it without gradients)."""
    from tests.training.test_gradients import GRAD_TOL, PAD, adamw_step, exported_grads, torch_loss_and_grads

    mesh = make_mesh(MESHES["fsdp2_ep4"])
    _, path, ids, loss, grads, after = adamw_step(tiny_checkpoints, tmp_path, kind, mesh, scan_layers)
    ref_loss, ref = torch_loss_and_grads(tiny_checkpoints(kind)[1], ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    ours = exported_grads(grads, path, tmp_path / "grads")
    assert set(ours) == set(ref)
    unused = {k for k, g in ref.items() if not np.any(g)}  # the indexer, the routing bias, experts not chosen
    assert {k for k in ref if ".indexer." in k} < unused and len(unused) < len(ref) // 3
    for key, grad in ours.items():
        if key in unused:
            assert not np.any(grad), key
        else:
            assert max_rel_diff(grad, ref[key]) <= GRAD_TOL, key
    assert float(after) < float(loss)


# MLA's projections (the fused kv_a_proj_with_mqa / kv_b_proj split by hooks after the merge), the
# dense and shared experts' MLPs, and the indexer's own projections.
LORA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj", "up_proj",
                "down_proj", "wq_b", "wk", "weights_proj"]
# kept as factors: MLA's fused projections (split between leaves) and the MLPs (PEFT turns their names
# into target_parameters of the fused routed experts) merge only, so they are left out
KEPT_TARGETS = ["q_a_proj", "q_b_proj", "o_proj", "wq_b", "wk", "weights_proj"]


@pytest.mark.parametrize(("kind", "scan_layers"), [("deepseek_v32", False), ("glm_moe_dsa", True)])
def test_peft_lora_adapters_merge_like_peft(tiny_checkpoints, tmp_path, kind, scan_layers):
    """The adapter merges on the fly and, on the attention and the indexer only, is kept as factors
    (``merge_adapter=False``): both logits equal ``PeftModel``'s; keeping a fused projection's factors
    is a typed error naming the leaf."""
    from otfload.errors import AdapterError
    from tests.adapters.support import kept_factors, make_adapter, peft_logits

    path, torch_model = tiny_checkpoints(kind)
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=LORA_TARGETS)
    kept_adapter = make_adapter(torch_model, tmp_path / "kept", r=2, lora_alpha=4, target_modules=KEPT_TARGETS)
    ids = token_ids(seq=12)
    reference = peft_logits(torch_model, [adapter], ids)
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > 1e-3  # the adapter matters
    mesh = make_mesh(MESHES["fsdp2_ep4"])
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh, scan_layers=scan_layers)
    kept = otfload.from_pretrained(path, adapter=kept_adapter, merge_adapter=False, mesh=mesh, scan_layers=scan_layers)
    assert kept_factors(kept)
    with jax.set_mesh(mesh):
        assert max_rel_diff(logits(model, ids), reference) <= 1e-4
        assert max_rel_diff(logits(kept, ids), peft_logits(torch_model, [kept_adapter], ids)) <= 1e-4
    with pytest.raises(AdapterError, match=r"leaf '[\w.]*attn\.k_b\.kernel'.+fused projection"):
        otfload.from_pretrained(path, adapter=adapter, merge_adapter=False, mesh=mesh, scan_layers=scan_layers)
