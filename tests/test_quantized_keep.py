"""``quantized="keep"``: quantized leaves placed packed, decoded by the pure-JAX ``otfload.dequantize``.

The reference is the default mode (``quantized="dequantize"``), itself checked against transformers
and numpy decoders in tests/test_quantized.py: every kept leaf must dequantise to exactly the same
bits, on meshes whose ``tp``/``ep`` shard edges cut through quantization groups, scanned and
unscanned; the kept model's logits must equal the dequantised model's.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.errors import InvalidOptionError
from otfload.quantized import QuantizedArray
from tests.helpers import jax_logits, token_ids
from tests.test_quantized import LAYOUTS, mesh_for
from tests.test_quantized import quantized as quantized_layouts  # noqa: F401  (a fixture)


@pytest.fixture(scope="module")
def quantized(quantized_layouts):  # noqa: F811
    """tests/test_quantized.py's checkpoints in every layout: ``quantized(layout) -> (dir, ...)``."""
    return quantized_layouts


def kept_leaves(model) -> dict[str, QuantizedArray]:
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)
            if isinstance(var.get_value(), QuantizedArray)}


def dense_leaves(model) -> dict[str, jax.Array]:
    state = nnx.state(model, nnx.Param)
    return {".".join(map(str, path)): var.get_value() for path, var in nnx.to_flat_state(state)}


def placed_bytes(leaf: QuantizedArray) -> int:
    return sum(s.data.nbytes for a in leaf.parts().values() for s in a.addressable_shards)


# GPTQ with desc_act: each input column takes its group from g_idx, so no block layout describes
# its scales; it loads dequantised under quantized="keep" (tested below).
NOT_KEPT = {"gptq_int4_desc_act"}


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("layout", sorted(set(LAYOUTS) - NOT_KEPT))
def test_dequantize_reproduces_the_default_mode_bit_for_bit(quantized, layout, scan_layers, mesh_2x4):
    path, *_ = quantized(layout)
    mesh = mesh_for(layout, mesh_2x4)
    dense, dense_report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, return_report=True)
    kept, report = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, quantized="keep",
                                           return_report=True)
    leaves, reference = kept_leaves(kept), dense_leaves(dense)
    assert leaves, "no leaf was kept quantized"
    for name, leaf in leaves.items():
        want = reference[name]
        assert leaf.shape == want.shape and leaf.dtype == want.dtype, name
        assert leaf.codes.dtype.itemsize <= 4 and leaf.codes.dtype != want.dtype, name
        got = jax.jit(otfload.dequantize)(leaf)
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8), err_msg=name)
        if leaf.codes.sharding.spec == want.sharding.spec:  # not coarsened: fewer bytes on every device
            assert placed_bytes(leaf) < sum(s.data.nbytes for s in want.addressable_shards), name
    assert report.bytes_read == dense_report.bytes_read  # the same stored bytes, not decoded


# Scanned and unscanned alternating over the layouts: both layer loops run kept weights, and every
# layout's kept leaves dequantise bit for bit in both modes (the test above).
@pytest.mark.parametrize(("layout", "scan_layers"), [
    ("mxfp4_gpt_oss", True), ("ct_fp8_channel", False), ("ct_w4a16_asym", True), ("awq_gemm", False),
    ("gptq_int4_sym", True),
])  # fmt: skip
def test_kept_model_logits_equal_the_dequantised_model(quantized, layout, scan_layers, mesh_2x4):
    path, *_ = quantized(layout)
    mesh = mesh_for(layout, mesh_2x4)
    dense = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype="float32")
    kept = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype="float32", quantized="keep")
    assert kept_leaves(kept)
    ids = token_ids()
    want, got = jax_logits(dense, ids), jax_logits(kept, ids)  # compiled whole, not run op by op
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_scan_slicing_keeps_a_valid_quantized_array(quantized, mesh_2x4):
    path, *_ = quantized("ct_w4a16")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, quantized="keep", dtype="float32")
    leaf = model.layers.mlp.down.kernel.get_value()
    assert isinstance(leaf, QuantizedArray) and leaf.codes.dtype == jnp.int32
    whole = np.asarray(otfload.dequantize(leaf))
    sliced = jax.tree.map(lambda a: a[1], leaf)
    assert sliced.shape == whole.shape[1:]
    np.testing.assert_array_equal(np.asarray(otfload.dequantize(sliced)), whole[1])
    np.testing.assert_array_equal(np.asarray(leaf[1].materialize()), whole[1])  # StoredWeight protocol
    with pytest.raises(IndexError):
        leaf[0, 1]  # only the leading (layer) axis indexes
    # inside lax.scan over the leading layer axis, each step sees one layer's QuantizedArray
    _, per_layer = jax.lax.scan(lambda c, w: (c, otfload.dequantize(w)), 0, leaf)
    np.testing.assert_array_equal(np.asarray(per_layer), whole)
    # the nnx Params hold the node through split / jit / merge
    graph, state = nnx.split(model)
    ids = jnp.asarray(token_ids())
    logits = jax.jit(lambda s, x: nnx.merge(graph, s)(x))(state, ids)
    # the session's jitted forward (test_kept_model_logits_equal_the_dequantised_model[gptq_int4_sym-True]'s program)
    want = jax_logits(otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32"), token_ids())
    # the merged state's jit fuses the forward differently from the dense model's: equal within float32 rounding
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_a_bad_mode_is_a_typed_error(quantized):
    path, *_ = quantized("ct_fp8_channel")
    with pytest.raises(InvalidOptionError, match="quantized='packed'"):
        otfload.from_pretrained(path, quantized="packed")


def test_load_params_keeps_a_brought_pytree_quantized(quantized, mesh_2x4):
    """A plain pytree (Equinox-style Llama, no hooks) gets QuantizedArray leaves; dequantised, they
    are the leaves of the default load."""
    import json

    from otfload.mappings.pytree_llama import TABLE, abstract_params

    path, *_ = quantized("ct_w4a16_asym")
    abstract = abstract_params(json.loads((path / "config.json").read_text()), mesh_2x4)
    dense = otfload.load_params(path, abstract, TABLE)
    kept = otfload.load_params(path, abstract, TABLE, quantized="keep")
    leaf = kept["layers"][1]["mlp"]["down_proj"]["weight"]
    assert isinstance(leaf, QuantizedArray) and leaf.zero_point is not None
    want = dense["layers"][1]["mlp"]["down_proj"]["weight"]
    np.testing.assert_array_equal(np.asarray(otfload.dequantize(leaf)), np.asarray(want))
    assert isinstance(kept["embed_tokens"]["weight"], jax.Array)  # unquantized leaves load as usual


def test_inspect_shows_the_bytes_each_device_holds(quantized, mesh_2x4):
    from otfload.cli.inspect import format_plan, inspect_source

    path, *_ = quantized("ct_w4a16")
    info = inspect_source(path, mesh=mesh_2x4, quantized="keep")
    dense_info = inspect_source(path, mesh=mesh_2x4)
    model = otfload.from_pretrained(path, mesh=mesh_2x4, quantized="keep")
    measured: dict[int, int] = {}
    for array in jax.tree.leaves(nnx.state(model, nnx.Param)):
        for shard in array.addressable_shards:
            measured[shard.device.id] = measured.get(shard.device.id, 0) + shard.data.nbytes
    assert info["placed_bytes_per_device"] == measured
    assert sum(measured.values()) < sum(dense_info["placed_bytes_per_device"].values())
    assert "layers.mlp.down.kernel" in info["quantized_kept"]
    text = format_plan(info)
    assert "kept quantized: 7 leaves placed packed" in text and "placed bytes per device: 0: " in text


@pytest.fixture(scope="module")
def deepseek_fp8(tiny_checkpoints, tmp_path_factory):
    """DeepSeek-V3 with every linear weight FP8 in 16x16 blocks (``_scale_inv``), as DeepSeek publishes."""
    import tests.families.test_deepseek  # noqa: F401  (registers the tiny kind)
    from tests.index.quant import layouts

    src, _ = tiny_checkpoints("deepseek_v3")
    dst = tmp_path_factory.mktemp("deepseek_fp8") / "ckpt"
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    assert layouts.quantize_checkpoint(src, dst, layouts.is_linear, layouts.fp8_blocks((16, 16)), config)
    return dst


def test_deepseek_fp8_keeps_what_its_hooks_allow_and_says_why_not(deepseek_fp8):
    mesh = otfload.make_mesh({"fsdp": 2, "ep": 4})
    _, plan, src = otfload.plan_model(deepseek_fp8, mesh=mesh, quantized="keep")
    src.close()
    # kv_b's widening reshape + slices (k_b, v_b) and the experts are kept; q_b's heads of 24 rows
    # cut through its 16-row blocks, so it loads dequantised and the plan says why.
    kept_paths = {"moe_layers.attn.k_b.kernel", "moe_layers.attn.v_b.kernel", "moe_layers.moe.experts.up.kernel"}
    assert kept_paths <= set(plan.kept)
    assert "splits blocks of 16 across axes (4, 24)" in plan.kept_notes["moe_layers.attn.q_b.kernel"]
    dense = otfload.from_pretrained(deepseek_fp8, mesh=mesh, dtype="float32")
    kept = otfload.from_pretrained(deepseek_fp8, mesh=mesh, dtype="float32", quantized="keep")
    reference = dense_leaves(dense)
    dequantize = jax.jit(otfload.dequantize)  # one program a leaf, not one an op
    for name, leaf in kept_leaves(kept).items():
        got = dequantize(leaf)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(reference[name]), err_msg=name)
    ids = token_ids()
    np.testing.assert_array_equal(jax_logits(kept, ids), jax_logits(dense, ids))  # compiled whole, not op by op


@pytest.mark.parametrize(("block", "dim", "dims", "want"), [
    (48, 64, (4, 16), (3, 16)),   # 3 heads per block; the last block is partial, as on the flat axis
    (8, 64, (4, 16), (1, 8)),
    (64, 64, (4, 16), (4, 16)),   # one block: the whole axis
    (32, 128, (2, 4, 16), (1, 2, 16)),
    (24, 64, (4, 16), None),      # 24 rows straddle heads of 16
])
def test_a_reshape_splits_blocks_from_the_innermost_axis(block, dim, dims, want):
    from otfload.index.quant.parts import NotKeepable
    from otfload.plan.keep import _split

    if want is None:
        with pytest.raises(NotKeepable):
            _split(block, dim, dims)
        return
    assert _split(block, dim, dims) == want
    # the same blocks as numpy sees them: element i of the flat axis is in block i // block
    flat = np.arange(dim) // block
    split = np.stack(np.meshgrid(*(np.arange(d) // b for d, b in zip(dims, want, strict=True)), indexing="ij"))
    grid = tuple(-(-d // b) for d, b in zip(dims, want, strict=True))
    np.testing.assert_array_equal(np.ravel_multi_index(tuple(split), grid).ravel(), flat)


def test_gptq_desc_act_loads_dequantised_and_the_plan_says_why(quantized, mesh_2x4):
    path, *_ = quantized("gptq_int4_desc_act")
    _, plan, src = otfload.plan_model(path, mesh=mesh_2x4, quantized="keep")
    src.close()
    assert not plan.kept
    assert "take their groups from g_idx (desc_act)" in plan.kept_notes["layers.mlp.down.kernel"]
    kept = otfload.from_pretrained(path, mesh=mesh_2x4, quantized="keep", dtype="float32")
    dense = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32")
    assert not kept_leaves(kept)
    ids = token_ids()
    np.testing.assert_array_equal(jax_logits(kept, ids), jax_logits(dense, ids))  # one program for both


def test_layers_only_follows_the_plan_not_the_leaf_names(quantized, mesh_2x4):
    """A bundled model keeps its layer stack packed whatever the stack is named (``decoder.h.{i}``
    unscanned, ``blocks`` scanned): the plan's ``{layer}`` rules say which leaves the layer loop
    materializes; a quantized weight the table reads outside any layer stays dequantised."""
    import json

    from otfload.stages.quantized import KeptQuantized

    path, *_ = quantized("ct_fp8_channel")
    config = json.loads((path / "config.json").read_text())
    n, hidden, inter = config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]
    replicated = jax.sharding.NamedSharding(mesh_2x4, jax.sharding.PartitionSpec())

    def leaf(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=replicated)

    abstract = {"decoder": {"h": [{"down": leaf(hidden, inter)} for _ in range(n)]},
                "blocks": {"up": leaf(n, inter, hidden)}, "head": leaf(hidden, inter)}
    table = [otfload.Rule("decoder.h.{layer}.down", "model.layers.{layer}.mlp.down_proj.weight"),
             otfload.Rule("blocks.up", "model.layers.{layer}.mlp.up_proj.weight"),
             otfload.Rule("head", "model.layers.0.mlp.down_proj.weight")]
    plan = otfload.plan_params(path, abstract, table)
    kept = KeptQuantized(layers_only=True).plan(plan)
    assert set(kept.kept) == {*(f"decoder.h.{i}.down" for i in range(n)), "blocks.up"}
    assert kept.kept_notes["head"] == "dequantised: used outside the layer loop"
    assert set(KeptQuantized(layers_only=False).plan(plan).kept) == {*kept.kept, "head"}
