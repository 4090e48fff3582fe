"""The tiled copy of transposed views (otfload.place.transpose) against np.transpose: every layout a
hook chain can produce lands bit-identical, and only transposed views take the tiled path."""

import jax
import ml_dtypes
import numpy as np
import pytest

from otfload.place import transpose
from otfload.place.transpose import copy_into, transposed_axis


def _random(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("shape", [(300, 517), (1024, 2048), (17, 4099), (4099, 17)])
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_2d_transpose_matches_numpy(shape, dtype):
    src = _random(shape, dtype)
    dst = np.empty(shape[::-1], dtype)
    copy_into(dst, src.T)
    np.testing.assert_array_equal(dst.view(np.uint8), np.ascontiguousarray(np.transpose(src)).view(np.uint8))


def test_transpose_then_reshape_and_crop_of_a_hook_chain():
    # HF q_proj [heads*hd, hidden] -> Transpose -> Reshape(hidden, heads, hd) -> a device's crop
    w = _random((8 * 32, 384))
    view = w.T.reshape(384, 8, 32)[96:288, 2:6]
    assert transposed_axis(view) is not None
    dst = np.empty(view.shape, np.float32)
    copy_into(dst, view)
    np.testing.assert_array_equal(dst, np.transpose(w).reshape(384, 8, 32)[96:288, 2:6])


@pytest.mark.parametrize("perm", [(2, 0, 1), (1, 2, 0), (0, 2, 1), (2, 1, 0), (1, 0, 2)])
def test_every_3d_permutation_with_a_cast(perm):
    src = _random((40, 64, 96), ml_dtypes.bfloat16)
    view = src.transpose(perm)
    dst = np.empty(view.shape, np.float32)
    copy_into(dst, view)
    np.testing.assert_array_equal(dst, np.transpose(src, perm).astype(np.float32))


def test_tiny_tiles_cover_ragged_edges(monkeypatch):
    monkeypatch.setattr(transpose, "TILE_SOURCE_ROWS", 3)
    monkeypatch.setattr(transpose, "TILE_SOURCE_BYTES", 20)
    monkeypatch.setattr(transpose, "MIN_TILED_ELEMENTS", 1)
    src = _random((37, 53))
    dst = np.full((53, 37), np.nan, np.float32)
    copy_into(dst, src.T)
    np.testing.assert_array_equal(dst, src.T)


def test_which_views_are_transposed():
    a = np.zeros((64, 128), np.float32)
    assert transposed_axis(a) is None                      # contiguous
    assert transposed_axis(a[:, 10:20]) is None            # rows of a crop: still read along the last axis
    assert transposed_axis(a[::-1].T) is None              # negative strides: plain copy
    assert transposed_axis(a.reshape(64, 1, 128).transpose(1, 0, 2)) is None  # a size-1 axis moved
    shape, strides, axis = transposed_axis(a.T)
    assert (shape, axis) == ([128, 64], 0) and strides == [4, 512]
    merged = transposed_axis(a.reshape(64, 8, 16).transpose(1, 2, 0))  # (8, 16) merge back: one 2-D transpose
    assert merged[0] == [128, 64] and merged[2] == 0


def test_a_mismatched_shape_is_numpy_s_error():
    with pytest.raises(ValueError):
        copy_into(np.empty((3, 4), np.float32), np.zeros((5, 4), np.float32).T[:3])


def test_bench_methods_load_the_same_weights(tmp_path, mesh_2x4):
    """benchmarks/bench_transpose.py compares like with like: its contiguous, transposed and
    tunix-style loads hold the same values, in their own layouts."""
    import json

    import otfload
    from benchmarks.bench_transpose import contiguous_target, tunix_style_load
    from benchmarks.make_checkpoint import Dims, write_checkpoint
    from otfload.mappings import linen_llama as mt

    directory = write_checkpoint(tmp_path / "c", Dims(hidden=512, intermediate=512, layers=2, vocab=1024))
    config = json.loads((directory / "config.json").read_text())
    dtype = np.dtype(ml_dtypes.bfloat16)
    abstract, table = contiguous_target(config, mesh_2x4, dtype)
    contiguous = otfload.load_params(directory, abstract, table)["params"]["decoder"]["layers"]
    transposed = otfload.load_params(directory, mt.abstract_params(config, mesh_2x4, dtype), mt.TABLE)
    tunix = tunix_style_load(directory, mt.abstract_params(config, mesh_2x4, dtype, scan_layers=False), config)
    layers = transposed["params"]["decoder"]["layers"]
    for name, perm in [("self_attention.query.kernel", (0, 3, 1, 2)), ("self_attention.out.kernel", (0, 2, 3, 1)),
                       ("mlp.wo.kernel", (0, 2, 1))]:
        ours = np.asarray(_get(layers, name), np.float32)
        np.testing.assert_array_equal(ours, np.asarray(_get(contiguous, name), np.float32).transpose(perm))
        for i in range(2):
            np.testing.assert_array_equal(ours[i], np.asarray(tunix[f"params.decoder.layers.{i}.{name}"], np.float32))


def _get(tree, dotted_name):
    for part in dotted_name.split("."):
        tree = tree[part]
    return tree


@pytest.mark.parametrize("xla", [True, False])
@pytest.mark.parametrize("piece_bytes", [1 << 22, 1000])  # one piece, and many pieces of a few rows
def test_xla_and_numpy_copies_agree(monkeypatch, xla, piece_bytes):
    monkeypatch.setattr(transpose, "XLA_TRANSPOSE", xla)
    monkeypatch.setattr(transpose, "XLA_PIECE_BYTES", piece_bytes)
    src = _random((96, 40, 130), ml_dtypes.bfloat16)
    view = src.transpose(2, 0, 1)[3:120]
    dst = np.empty(view.shape, np.float32)
    copy_into(dst, view)
    np.testing.assert_array_equal(dst, np.ascontiguousarray(view).astype(np.float32))


def test_dtypes_jax_would_change_stay_in_numpy(cpu_sharding):
    src = _random((300, 517), np.float64)  # float64 without jax_enable_x64 would become float32
    dst = np.empty((517, 300), np.float64)
    copy_into(dst, src.T)
    np.testing.assert_array_equal(dst, src.T)
    assert not transpose.xla_copies(src.T, np.dtype(np.float64), cpu_sharding)


@pytest.fixture
def cpu_sharding():
    return jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])


def test_xla_copies_only_large_transposed_views_without_a_cast(cpu_sharding):
    src = _random((300, 517), ml_dtypes.bfloat16)
    assert transpose.xla_copies(src.T, src.dtype, cpu_sharding)
    assert not transpose.xla_copies(src.T, np.dtype(np.float32), cpu_sharding)  # a cast: the builder's copy
    assert not transpose.xla_copies(src, src.dtype, cpu_sharding)  # not transposed: adopted as is
    assert not transpose.xla_copies(src[:10, :10].T, src.dtype, cpu_sharding)  # small: one np.copyto


def test_a_transposed_view_placed_as_is_holds_the_transpose(cpu_sharding):
    from otfload.place.put import place_shards

    src = _random((300, 517), ml_dtypes.bfloat16)
    view = src.T
    placed = place_shards(view.shape, view.dtype, cpu_sharding, [view], list(cpu_sharding.device_set))
    want = np.ascontiguousarray(view).view(np.uint16)
    src[:] = 0  # the placed array is XLA's copy, not a view of ours
    np.testing.assert_array_equal(np.asarray(placed).view(np.uint16), want)
