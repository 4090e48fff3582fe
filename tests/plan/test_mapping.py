import pytest

from otfload.errors import MappingError
from otfload.plan.hooks import Transpose
from otfload.plan.mapping import MappingTable, Rule, as_table, format_key, placeholders

Q = Rule("layers.{layer}.attn.q.kernel", "model.layers.{layer}.self_attn.q_proj.weight", (Transpose(),))
W1 = Rule("layers.{layer}.moe.w1", "model.layers.{layer}.experts.{expert}.w1.weight")


def test_unscanned_leaf_fixes_the_layer():
    assert Q.match("layers.3.attn.q.kernel") == ({"layer": 3}, ())


def test_scanned_leaf_stacks_the_layer():
    assert Q.match("layers.attn.q.kernel") == ({}, ("layer",))


def test_placeholder_only_in_source_is_stacked():
    assert W1.match("layers.2.moe.w1") == ({"layer": 2}, ("expert",))
    assert W1.match("layers.moe.w1") == ({}, ("layer", "expert"))
    swapped = Rule(W1.target, W1.source, stack_order=("expert", "layer"))
    assert swapped.match("layers.moe.w1") == ({}, ("expert", "layer"))


def test_no_partial_matches():
    assert Q.match("layers.3.attn.q.kernel.extra") is None
    assert Q.match("xlayers.3.attn.q.kernel") is None
    assert Q.match("layers.x.attn.q.kernel") is None


def test_target_placeholder_missing_from_source_is_rejected():
    with pytest.raises(MappingError, match="expert"):
        Rule("experts.{expert}.w", "model.w")


def test_table_first_match_wins_and_ignores():
    table = MappingTable((Q, Rule("layers.{layer}.attn.q.kernel", "other.{layer}")), ignore=(r".*inv_freq",))
    rule, fixed, stacked = table.find("layers.0.attn.q.kernel")
    assert rule is Q and fixed == {"layer": 0} and stacked == ()
    assert table.find("nothing") is None
    assert table.ignored("model.layers.0.rotary_emb.inv_freq")
    assert not table.ignored("model.layers.0.q")


def test_helpers():
    assert placeholders("a.{x}.b.{y}.{x}") == ["x", "y"]
    assert format_key("m.{layer}.e.{expert}", {"layer": 1, "expert": 7}) == "m.1.e.7"
    table = as_table({"w": "model.w"})
    assert table.find("w")[0].source == "model.w"
    assert as_table([Q]).rules == (Q,)


def test_source_prefixes_rename_sources_and_fallbacks():
    table = MappingTable((Rule("head", "lm_head.weight", fallbacks=("model.embed.weight",)), Q))
    moved = table.with_source_prefixes({"model.": "language_model.model.", "lm_head.": "language_model.lm_head."})
    head, q = moved.rules
    assert head.source == "language_model.lm_head.weight" and head.fallbacks == ("language_model.model.embed.weight",)
    assert q.source == "language_model.model.layers.{layer}.self_attn.q_proj.weight" and q.hooks == Q.hooks
