"""``otfload inspect --mapping MODULE:TABLE --target MODULE:FACTORY``: a brought model's plan from
headers alone, as text and JSON, and its errors."""

import json

from otfload.cli import main


def test_inspect_prints_the_custom_plan(tiny_checkpoints, capsys):
    path, _ = tiny_checkpoints("llama")
    argv = ["inspect", str(path), "--mesh", "fsdp=2,tp=4", "--mapping", "otfload.mappings.linen_llama:TABLE",
            "--target", "otfload.mappings.linen_llama:abstract_params"]
    assert main([*argv, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "custom mapping otfload.mappings.linen_llama:TABLE" and info["scan_layers"] is None
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    wo = leaves["params.decoder.layers.mlp.wo.kernel"]
    assert wo["shape"] == [3, 128, 64] and wo["hooks"] == ["Transpose(perm=None)"] and wo["num_hf_keys"] == 3
    assert wo["sharding"] == "P(None, 'tp', 'fsdp')" and wo["process_bytes"] == 3 * 128 * 64 * 4
    assert main(argv) == 0
    assert "params.decoder.layers.self_attention.query.kernel  (3, 64, 4, 16)" in capsys.readouterr().out


def test_inspect_lists_unmapped_leaves_and_rejects_half_the_options(tiny_checkpoints, capsys):
    path, _ = tiny_checkpoints("llama")
    argv = ["inspect", str(path), "--mapping", "otfload.mappings.pytree_llama:TABLE",
            "--target", "otfload.mappings.linen_llama:abstract_params"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "no mapping rule matches leaf 'params.token_embedder.embedding'" in out
    assert main(["inspect", str(path), "--mapping", "otfload.mappings.pytree_llama:TABLE"]) == 2
    assert main(["inspect", str(path), "--mapping", "otfload.mappings.nothing:TABLE", "--target", "x:y"]) == 1
    assert "cannot load 'otfload.mappings.nothing:TABLE'" in capsys.readouterr().err
