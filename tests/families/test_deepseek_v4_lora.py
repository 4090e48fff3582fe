"""PEFT LoRA on DeepSeek-V4 (tests/families/test_deepseek_v4.py's tiny model): adapters PEFT builds on
transformers' model, on its runtime names (the main attention's ``q_a_proj``, ``q_b_proj``, ``kv_proj``,
``o_a_proj`` and ``o_b_proj``, stored as ``wq_a``, ``wq_b``, ``wkv``, ``wo_a``, ``wo_b``; the shared
expert's ``gate_proj``/``up_proj``/``down_proj``, stored as ``w1``/``w3``/``w2``; through
``target_parameters``, the routed experts fused as ``mlp.experts.gate_up_proj``/``down_proj``), merged on
the fly and kept as factors: float32 logits on the scanned ``fsdp2_ep4`` mesh equal those of
``PeftModel.merge_and_unload()`` (``o_a_proj`` is a grouped linear that PEFT's unmerged forward cannot
run), which each adapter moves well past the bound. Keeping the fused experts' factors is a typed error
naming the module. The release's names (``layers.{i}.attn.wq_a.weight``, no ``model.``) take the same
adapter. The hyper-connections' parameters are not linear modules; the compressors' and the
indexer's projections are left out (the regexes keep ``kv_proj`` to the attention's own).
"""

import shutil

import jax
import pytest

import otfload
import tests.families.test_deepseek_v4  # noqa: F401  (registers the tiny DeepSeek-V4)
from otfload.errors import AdapterError
from otfload.plan.sharding import make_mesh
from tests.adapters.support import kept_factors, make_adapter, merged_peft_logits
from tests.adapters.test_parity import MIN_EFFECT, TOLERANCE
from tests.families.checks import MESHES, reference_logits
from tests.families.test_deepseek_v4_quantized import release_name
from tests.helpers import hf_tensors, jax_logits, max_rel_diff, token_ids

ATTENTION = r".*\.self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj)"
SHARED = r".*\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
IDS = token_ids(seq=20)  # past the sliding window, both compressors' windows and the indexer's top 2
# merge_adapter -> the adapter's LoRA config: kept factors for the linear modules only
LORA = {
    True: dict(target_modules=f"({ATTENTION})|({SHARED})", target_parameters=EXPERTS),
    False: dict(target_modules=f"({ATTENTION})|({SHARED})"),
}


def mesh():
    return make_mesh(MESHES["fsdp2_ep4"])  # test_deepseek_v4's scanned mesh: experts on ep


@pytest.fixture(scope="module")
def adapters(tiny_checkpoints, tmp_path_factory):
    """The checkpoint, transformers' model and, per ``merge_adapter``, an adapter with random factors."""
    path, torch_model = tiny_checkpoints("deepseek_v4")
    root = tmp_path_factory.mktemp("deepseek_v4_lora")
    dirs = {
        merge: make_adapter(torch_model, root / str(merge), r=2, lora_alpha=4, seed=int(merge), **lora)
        for merge, lora in LORA.items()
    }
    return path, torch_model, dirs


@pytest.mark.parametrize("merge_adapter", [True, False], ids=["merged", "kept"])
def test_peft_lora_matches_peft_merge_and_unload(adapters, merge_adapter):
    path, torch_model, dirs = adapters
    reference = merged_peft_logits(torch_model, dirs[merge_adapter], IDS)
    model = otfload.from_pretrained(path, adapter=dirs[merge_adapter], merge_adapter=merge_adapter, mesh=mesh())
    # kept: 5 attention and 3 shared-expert factor pairs in each of the 3 scanned groups (sliding and
    # hash-routed, CSA and top-k, HCA and top-k)
    assert len(kept_factors(model)) == (0 if merge_adapter else 8 * 3)
    with jax.set_mesh(mesh()):
        diff = max_rel_diff(jax_logits(model, IDS), reference)
    assert diff <= TOLERANCE, diff
    assert max_rel_diff(reference_logits(torch_model, IDS), reference) > MIN_EFFECT


def test_keeping_the_fused_experts_factors_is_refused_by_module(adapters):
    path, _, dirs = adapters
    with pytest.raises(AdapterError, match=r"module 'model\.layers\.\d+\.mlp\.experts'.+target_parameters"):
        otfload.from_pretrained(path, adapter=dirs[True], merge_adapter=False, mesh=mesh())


def test_the_release_names_take_the_same_adapter(adapters, tmp_path):
    """The tiny checkpoint under V4-Flash's names (unquantised): the merged adapter's logits as above."""
    from safetensors.numpy import save_file

    path, torch_model, dirs = adapters
    release = tmp_path / "release"
    release.mkdir()
    shutil.copy(path / "config.json", release)
    save_file({release_name(k): v for k, v in hf_tensors(path).items()}, release / "model.safetensors")
    model = otfload.from_pretrained(release, adapter=dirs[True], mesh=mesh())
    with jax.set_mesh(mesh()):
        diff = max_rel_diff(jax_logits(model, IDS), merged_peft_logits(torch_model, dirs[True], IDS))
    assert diff <= TOLERANCE, diff
