"""OLMo 3: tiny transformers checkpoints → otfload → logits and greedy ids equal transformers',
the export round trip bit-exact, and the config fields otfload does not implement refused by name.

Sliding and full layers alternate (a window of 4 on 12-token inputs, so the window bites), each type
with its own RoPE (YaRN on the full layers), and the q/k norms span the whole projections."""

import json

import pytest

import otfload
from otfload.errors import ConfigError
from otfload.families.olmo3.config import Olmo3Config
from tests.families.checks import NEW, assert_export_round_trip, assert_greedy_matches
from tests.helpers import BASE, max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.helpers import jax_logits as logits

SLIDING, FULL = "sliding_attention", "full_attention"
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 5e5}
OLMO3_BASE = {**BASE, "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 4,
              "layer_types": [SLIDING, FULL, SLIDING, SLIDING],
              "rope_parameters": {FULL: YARN, SLIDING: {"rope_type": "default", "rope_theta": 1e4}}}


def _olmo3(**kw):
    from transformers import Olmo3Config as HfOlmo3Config
    from transformers import Olmo3ForCausalLM

    return Olmo3ForCausalLM(HfOlmo3Config(**{**OLMO3_BASE, **kw}))


register_hf_model("olmo3", _olmo3)
register_hf_model("olmo3_tied_bias", _olmo3, {"tie_word_embeddings": True, "attention_bias": True,
                                              "num_key_value_heads": 4})
KINDS = ["olmo3", "olmo3_tied_bias"]


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_f32_logits_match_transformers(tiny_checkpoints, mesh_2x4, kind, scan_layers):
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers)
    if scan_layers:  # one stack although sliding and full layers alternate; q norm over every head
        assert model.layers.attn.q_norm.scale[...].shape == (4, 4, 32)
    ids = token_ids(seq=12)
    diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_window_rope_per_type_and_whole_projection_norm_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: all layers full, or one RoPE for both types, changes the logits."""
    import dataclasses

    path, torch_model = tiny_checkpoints("olmo3")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    cfg = model.cfg
    for changed in (dataclasses.replace(cfg, layer_types=(FULL,) * 4),
                    dataclasses.replace(cfg, rope_full=cfg.rope_sliding)):
        model.cfg = changed
        assert max_rel_diff(logits(model, ids), ref) > 1e-3
    model.cfg = cfg


@pytest.mark.parametrize("scan_layers", [True, False])
def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh_2x4, scan_layers):
    path, torch_model = tiny_checkpoints("olmo3")
    assert NEW > 4  # enough new tokens to cross the window while decoding
    assert_greedy_matches(otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers), torch_model)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, kind, scan_layers):
    src, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out")


def test_default_layer_pattern_and_flat_rope_follow_transformers():
    base = {**BASE, "model_type": "olmo3", "num_hidden_layers": 8, "rope_theta": 1e4,
            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    cfg = Olmo3Config.from_hf(base)
    assert cfg.layer_types == (SLIDING, SLIDING, SLIDING, FULL) * 2
    assert cfg.rope_full == (1e4, {"rope_type": "linear", "factor": 2.0}) and cfg.rope_sliding == (1e4, None)


@pytest.mark.parametrize(("field", "value"), [("layer_types", ["sliding_attention", "chunked_attention"] * 2),
                                              ("hidden_act", "gelu"),
                                              ("rope_parameters", {FULL: {"rope_type": "longrope"}})])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**BASE, "model_type": "olmo3", "num_hidden_layers": 4, field: value}
    with pytest.raises(ConfigError) as err:
        Olmo3Config.from_hf(json.loads(json.dumps(config)))
    assert field in err.value.field


@pytest.mark.parametrize("scan_layers", [True, False])
def test_peft_lora_merges_like_peft(tiny_checkpoints, mesh_2x4, tmp_path, scan_layers):
    """A PEFT adapter on every projection merges on the fly and is kept as factors
    (``merge_adapter=False``): both logits equal ``PeftModel``'s, and the adapter moves them well past
    the bound."""
    from tests.adapters.support import ALL_PROJECTIONS, kept_factors, make_adapter, peft_logits

    path, torch_model = tiny_checkpoints("olmo3")
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh_2x4, scan_layers=scan_layers)
    assert max_rel_diff(logits(model, ids), reference) <= 1e-4
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > 1e-3
    kept = otfload.from_pretrained(path, adapter=adapter, merge_adapter=False, mesh=mesh_2x4, scan_layers=scan_layers)
    assert kept_factors(kept)
    assert max_rel_diff(logits(kept, ids), reference) <= 1e-4
