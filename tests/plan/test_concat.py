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
