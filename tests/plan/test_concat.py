"""Concatenated tensors against numpy: MaxText's Qwen3.5 ``in_proj_qkvz`` / ``in_proj_ba`` joins (per key
head, as its converter builds them) read box by box from the stored tensors' boxes, planned and built
by a rule's ``Join``, and exported back."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from otfload.errors import CheckpointMismatchError, MappingError
from otfload.export.inverse import plan_export
from otfload.index.checkpoint import open_index
from otfload.index.concat import ConcatenatedTensor, Piece, head_blocks
from otfload.index.derived import is_derived
from otfload.index.header import TensorInfo
from otfload.place.builder import ByteBudget, build_leaf
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.hooks import Transpose
from otfload.plan.mapping import Join, MappingTable, Rule
from otfload.plan.planner import build_plan
from otfload.read.arena import Arena
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource
from tests.synthetic import write_checkpoint

HK, DK, HV, DV, EMB = 2, 3, 4, 2, 5  # key heads, key dim, value heads, value dim, hidden
VPK = HV // HK


def info(name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, np.dtype(np.float32), shape, "f", 0, 4 * int(np.prod(shape)))


def boxes(shape: tuple[int, ...]):
    spans = [[(a, b) for a, b in itertools.combinations(range(d + 1), 2)] for d in shape]
    return itertools.product(*spans)


def read(arrays: dict[str, np.ndarray], tensor: ConcatenatedTensor, box) -> np.ndarray:
    parts = tensor.part_boxes(box)
    return tensor.decode({r: arrays[i.name][tuple(slice(a, b) for a, b in pb)] for r, (i, pb) in parts.items()}, box)


CONFIG = {"hk": HK, "dk": DK, "hv": HV, "dv": DV}
JOINED = MappingTable((Rule("layers.{layer}.qkvz", "l.{layer}.qkvz", (Transpose(),),
                            join=Join((("l.{layer}.qkv", ("hk * dk", "hk * dk", "hv * dv")),
                                       ("l.{layer}.z", ("hv * dv",))), "hk")),))


def maxtext_qkvz(qkv: np.ndarray, z: np.ndarray) -> np.ndarray:
    """MaxText's converter: q, k, v and z each ``[key heads, rows per head, in]``, joined per head."""
    q, k, v = qkv[: HK * DK], qkv[HK * DK : 2 * HK * DK], qkv[2 * HK * DK :]
    cols = qkv.shape[1]
    return np.concatenate([q.reshape(HK, DK, cols), k.reshape(HK, DK, cols), v.reshape(HK, VPK * DV, cols),
                           z.reshape(HK, VPK * DV, cols)], axis=1).reshape(-1, cols)


@pytest.fixture
def qkvz():
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((2 * HK * DK + HV * DV, EMB)).astype(np.float32)
    z = rng.standard_normal((HV * DV, EMB)).astype(np.float32)
    expected = maxtext_qkvz(qkv, z)
    tensor = head_blocks("qkvz", [(info("qkv", qkv.shape), (HK * DK, HK * DK, HV * DV)),
                                  (info("z", z.shape), (HV * DV,))], HK)
    return tensor, {"qkv": qkv, "z": z}, expected


def test_qkvz_every_box(qkvz):
    tensor, arrays, expected = qkvz
    assert is_derived(tensor) and tensor.shape == expected.shape and tensor.dtype == np.float32
    assert tensor.nbytes == sum(a.nbytes for a in arrays.values())
    for box in boxes(tensor.shape):
        got = read(arrays, tensor, box)
        np.testing.assert_array_equal(got, expected[tuple(slice(a, b) for a, b in box)])


def test_part_boxes_read_only_what_the_box_covers(qkvz):
    tensor, _, _ = qkvz
    # the first head's q rows of column 1..3: one piece, its stored box alone
    assert tensor.part_boxes(((0, DK), (1, 3))) == {"0": (tensor.pieces[0].info, ((0, DK), (1, 3)))}
    # head 1's k rows: the k block's second run
    lo = 2 * DK + 2 * VPK * DV + DK
    (role, (part, pbox)), = tensor.part_boxes(((lo, lo + DK), (0, EMB))).items()
    assert part.name == "qkv" and pbox == ((HK * DK + DK, HK * DK + 2 * DK), (0, EMB))


def test_ba_and_axis_one():
    rng = np.random.default_rng(1)
    b, a = (rng.standard_normal((HV, EMB)).astype(np.float32) for _ in range(2))
    ba = head_blocks("ba", [(info("b", b.shape), (HV,)), (info("a", a.shape), (HV,))], HK)
    expected = np.concatenate([b.reshape(HK, VPK, EMB), a.reshape(HK, VPK, EMB)], axis=1).reshape(-1, EMB)
    for box in boxes(ba.shape):
        np.testing.assert_array_equal(read({"b": b, "a": a}, ba, box), expected[tuple(slice(x, y) for x, y in box)])
    cols = ConcatenatedTensor("bt", (Piece(info("bt", b.T.shape), 0, HV), Piece(info("at", a.T.shape), 1, 3)), axis=1)
    whole = np.concatenate([b.T, a.T[:, 1:3]], axis=1)
    assert cols.shape == whole.shape
    for box in boxes(cols.shape):
        got = read({"bt": b.T, "at": a.T}, cols, box)
        np.testing.assert_array_equal(got, whole[tuple(slice(x, y) for x, y in box)])


def test_refusals():
    with pytest.raises(MappingError, match="do not join"):
        ConcatenatedTensor("x", (Piece(info("a", (2, 3)), 0, 2), Piece(info("b", (2, 4)), 0, 2)))
    with pytest.raises(MappingError, match="do not join"):
        ConcatenatedTensor("x", (Piece(info("a", (2, 3)), 0, 3),))
    with pytest.raises(MappingError, match="no tensors"):
        ConcatenatedTensor("x", ())
    with pytest.raises(MappingError, match="heads"):
        head_blocks("x", [(info("a", (5, 3)), (5,))], 2)


@pytest.mark.parametrize("spec", [P(None, "fsdp", "tp"), P(None, None, "tp"), P("fsdp", "tp")])
def test_a_sharded_stacked_leaf_reads_each_piece_straight(tmp_path, mesh_2x4, closing, spec):
    """The whole byte plan on a real checkpoint: a scanned ``[layers, in, qkvz]`` leaf of a ``Rule.join``,
    each device's shard equal to numpy's, each stored tensor's bytes read no more than once per process
    (none unexpected under ``strict``), and export giving every stored tensor back."""
    rng = np.random.default_rng(2)
    layers, rows = 2, 2 * HK * DK + HV * DV
    tensors = {f"l.{i}.{n}": rng.standard_normal((r, 2 * EMB - 2), dtype=np.float32)
               for i in range(layers) for n, r in (("qkv", rows), ("z", HV * DV))}
    index = open_index(closing(LocalSource(write_checkpoint(tmp_path / "c", tensors))), require_config=False)
    want = np.stack([maxtext_qkvz(tensors[f"l.{i}.qkv"], tensors[f"l.{i}.z"]).T for i in range(layers)])
    sharding = NamedSharding(mesh_2x4, spec)
    leaves, _ = abstract_from_pytree({"layers": {"qkvz": jax.ShapeDtypeStruct(want.shape, np.float32,
                                                                              sharding=sharding)}})
    plan = build_plan(index, leaves, JOINED, CONFIG, strict=True).leaves["layers.qkvz"]
    assert plan.storage == "float32 (concatenated)" and plan.source_bytes == sum(t.nbytes for t in tensors.values())
    reader = TensorReader(index.source)
    array = build_leaf(plan, reader, Arena(), ByteBudget(None))
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    assert reader.stats.bytes_needed <= plan.source_bytes
    # export: the leaf back to each stored tensor, bit-exact
    export = plan_export({"layers.qkvz": want.shape}, JOINED, CONFIG, {k: v.shape for k, v in tensors.items()})
    assert set(export.tensors) == set(tensors)
    host = np.asarray(array)
    for key, tensor in export.tensors.items():
        assert tensor.materialize(lambda leaf, index: host[index]).tobytes() == tensors[key].tobytes()


def test_a_missing_part_is_named(tmp_path, closing, mesh_2x4):
    tensors = {"l.0.qkv": np.zeros((2 * HK * DK + HV * DV, 4), np.float32)}
    index = open_index(closing(LocalSource(write_checkpoint(tmp_path / "c", tensors))), require_config=False)
    leaf = jax.ShapeDtypeStruct((1, 4, 2 * HK * DK + 2 * HV * DV), np.float32, sharding=NamedSharding(mesh_2x4, P()))
    leaves, _ = abstract_from_pytree({"layers": {"qkvz": leaf}})
    with pytest.raises(CheckpointMismatchError, match="l.0.z"):
        build_plan(index, leaves, JOINED, CONFIG)


def test_source_prefixes_rename_the_parts():
    (rule,) = JOINED.with_source_prefixes({"l.": "text.l."}).rules
    assert rule.source == "text.l.{layer}.qkvz" and rule.join is not None
    assert [t for t, _ in rule.join.parts] == ["text.l.{layer}.qkv", "text.l.{layer}.z"]


FP8_BLOCK = 4  # scale blocks of 4 x 4: a key head's 3 q/k rows and 4 v/z rows run across block edges


def fp8_blocks(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` as FP8 e4m3 codes with one float32 scale per block (Qwen's / DeepSeek's ``weight_scale_inv``)
    and numpy's dequantisation of them (codes times their block's scale)."""
    import ml_dtypes

    grid = [-(-n // FP8_BLOCK) for n in w.shape]
    padded = np.zeros([g * FP8_BLOCK for g in grid], np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    amax = np.abs(padded.reshape(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK)).max(axis=(1, 3))
    scale = (np.maximum(amax, 1e-12) / np.float32(448)).astype(np.float32)
    full = np.repeat(np.repeat(scale, FP8_BLOCK, 0), FP8_BLOCK, 1)[: w.shape[0], : w.shape[1]]
    codes = (w / full).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale, codes.astype(np.float32) * full


FP8_CONFIG = {"model_type": "synthetic", "quantization_config": {
    "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [FP8_BLOCK] * 2}}


@pytest.fixture
def fp8_qkvz(tmp_path, closing):
    """A layer's ``qkv`` and ``z`` stored block-scaled FP8 , the index
    over them, and numpy's joined dequantised values."""
    rng = np.random.default_rng(3)
    stored, dequantised = {}, {}
    for name, rows in (("qkv", 2 * HK * DK + HV * DV), ("z", HV * DV)):
        codes, scale, dequantised[name] = fp8_blocks(rng.standard_normal((rows, EMB)).astype(np.float32))
        stored |= {f"l.0.{name}.weight": codes, f"l.0.{name}.weight_scale_inv": scale}
    index = open_index(closing(LocalSource(write_checkpoint(tmp_path / "c", stored, config=FP8_CONFIG))))
    return index, stored, maxtext_qkvz(dequantised["qkv"], dequantised["z"])


def test_quantized_parts_decode_as_they_are_read(fp8_qkvz):
    """Every box of the join of two FP8 tensors: each part's codes and scales read for its rows alone,
    decoded, joined; equal to numpy's dequantisation of the parts joined."""
    index, stored, expected = fp8_qkvz
    parts = [index["l.0.qkv.weight"], index["l.0.z.weight"]]
    assert all(is_derived(p) for p in parts)
    tensor = head_blocks("qkvz", [(parts[0], (HK * DK, HK * DK, HV * DV)), (parts[1], (HV * DV,))], HK)
    assert tensor.shape == expected.shape and tensor.dtype == np.float32 and "fp8" in tensor.storage
    for box in boxes(tensor.shape):
        np.testing.assert_array_equal(read(stored, tensor, box), expected[tuple(slice(a, b) for a, b in box)])
    # head 1's first q row, column 0 (piece 4: head 0's q, k, v, z come first): one code and one scale alone
    lo = 2 * DK + 2 * VPK * DV
    assert {r: (i.name, b) for r, (i, b) in tensor.part_boxes(((lo, lo + 1), (0, 1))).items()} == {
        "4.codes": ("l.0.qkv.weight", ((DK, DK + 1), (0, 1))),
        "4.scale": ("l.0.qkv.weight_scale_inv", ((0, 1), (0, 1)))}


def test_a_quantized_join_loads_sharded(fp8_qkvz, mesh_2x4):
    """The whole read path (planner, reader, builder) on a sharded ``[in, qkvz]`` leaf of a joined rule
    whose parts are FP8: each device's shard equals numpy's dequantised join."""
    index, _, expected = fp8_qkvz
    table = MappingTable((Rule("qkvz", "l.0.qkvz", (Transpose(),), join=Join(
        (("l.0.qkv.weight", ("hk * dk", "hk * dk", "hv * dv")), ("l.0.z.weight", ("hv * dv",))), "hk")),))
    leaves, _ = abstract_from_pytree({"qkvz": jax.ShapeDtypeStruct(expected.T.shape, np.float32,
                                                                  sharding=NamedSharding(mesh_2x4, P(None, "tp")))})
    plan = build_plan(index, leaves, table, CONFIG, strict=True).leaves["qkvz"]
    array = build_leaf(plan, TensorReader(index.source), Arena(), ByteBudget(None))
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), expected.T[shard.index])
