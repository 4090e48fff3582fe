"""Round trip HF → otfload → HF, bit-exact, for the MoE, Gemma, DeepSeek and GPT-OSS families
(stacked experts, layer index lists, MLA ``kv_b`` slices, GPT-OSS gate/up interleave)."""

import pytest

import otfload
import tests.families.test_deepseek  # noqa: F401  (registers the tiny HF models used below)
import tests.families.test_gemma  # noqa: F401
import tests.families.test_gpt_oss  # noqa: F401
import tests.families.test_mixtral  # noqa: F401
import tests.families.test_qwen3_moe  # noqa: F401
from otfload.export import export_hf
from tests.export.test_export import assert_bit_exact, read_tensors, weight_map_keys

FAMILIES = ["deepseek_v2", "deepseek_v3", "gemma2", "gemma3_text", "gpt_oss", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("name", FAMILIES)
def test_family_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, name):
    src, _ = tiny_checkpoints(name)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=True)
    out = export_hf(model, tmp_path / "out", config=src, max_shard_size="60KB")  # HF shapes inferred
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert weight_map_keys(out) == weight_map_keys(src)
