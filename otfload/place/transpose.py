"""Cache-blocked copies of transposed views: the builder's copy step when a hook chain permutes axes.

A ``Transpose`` hook is a view: copying it into a row-major buffer reads the source with a large
stride (one source row per element written). ``np.copyto`` walks the destination in order, so each
element it writes comes from another source row — another page, and for row strides near a
multiple of 4 KiB the same few cache sets — and the hardware prefetcher, which follows sequential
streams within a page, cannot help: measured ~1.9 ns per element against ~0.15 ns for a contiguous
copy (a 22 MiB bf16 matrix: 20 ms against 1.5 ms, 2 vCPU AMD EPYC).

:func:`copy_into` cuts the copy into tiles of :data:`TILE_SOURCE_ROWS` source rows by
:data:`TILE_SOURCE_BYTES` of each: a tile reads a few short sequential streams the prefetcher
tracks, and writes lines that stay in cache until the next tile completes them. Pure numpy, no
scratch memory: each tile is one ``np.copyto`` between views, so the memory budget is unchanged.

Faster still is XLA's own host transpose (the blocked SIMD kernels ``jax.device_put`` runs when it is
handed a strided array, as tunix's loader does): where JAX has a CPU backend, :func:`copy_into`
hands the transposed view to it in pieces of at most :data:`XLA_PIECE_BYTES`, then copies each
result — now contiguous — into ``dst`` with one ``np.copyto`` (which also casts). Measured on a
device's (768, 1056) bf16 box of a transposed MLP kernel: 0.64 ms against 1.8 ms tiled and 1.6 ms
for one ``np.copyto``; the 1 GiB ``[in, out]`` Llama load took 1.93 CPU-s against 2.61 tiled
(``benchmarks/bench_transpose.py``, medians of 6). A piece's XLA buffer is freed before the next is
made, so the extra memory is one piece, and dtypes JAX would change (float64 without x64) stay in
numpy. Where a transposed box is a whole shard (an unstacked leaf, no cast) on CPU devices,
:func:`xla_copies` lets the builder hand the view itself to the placement: XLA copies every shard
of the leaf straight into its device buffer, in one batched call — no buffer of ours, no second copy
(tunix's loader does the same for every leaf). On the 1 GiB unscanned ``[in, out]`` Llama load this
took 1,320 single-shard XLA calls and as many numpy views of their results out of the load.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax
import numpy as np

from otfload.place.put import to_host_device

# Source rows per tile (the destination's columns): the L2 stream prefetcher tracks on the order of
# 16 sequential streams (one per source row, each in its own page); 8 and 32 measured 10-50 % slower
# on the 22 MiB bf16 matrix (benchmarks/bench_transpose.py --kernel).
TILE_SOURCE_ROWS = 16
# Bytes of each source row per tile: 2 KiB (1024 bf16) makes a tile 16 K elements, so the ~1.5 us
# cost of one numpy call stays under 10 % of the copy; 512 B and 8 KiB measured slower.
TILE_SOURCE_BYTES = 2048
# Below this many elements the whole copy fits in L2 and one plain ``np.copyto`` is as fast.
MIN_TILED_ELEMENTS = 1 << 15
# Transposed copies go through XLA's host transpose (see the module docstring) when True and JAX has
# a CPU backend; False keeps them in numpy (the tiled copy).
XLA_TRANSPOSE = True
# The largest piece handed to XLA at once: its temporary buffer stays small and, below glibc's mmap
# threshold, is reused from piece to piece instead of faulting in fresh pages each time.
XLA_PIECE_BYTES = 4 << 20

Casting = Literal["no", "equiv", "safe", "same_kind", "unsafe"]  # numpy's casting rules


def _coalesced(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """Shape and strides of a view with size-1 axes dropped and adjacent axes merged where the
    outer one steps exactly over the inner one (so a C-contiguous destination merges them too)."""
    dims = [(n, s) for n, s in zip(shape, strides, strict=True) if n != 1]
    out_shape: list[int] = []
    out_strides: list[int] = []
    for n, s in dims:
        if out_shape and out_strides[-1] == n * s:
            out_shape[-1] *= n
            out_strides[-1] = s
        else:
            out_shape.append(n)
            out_strides.append(s)
    return out_shape, out_strides


def transposed_axis(src: np.ndarray) -> tuple[list[int], list[int], int] | None:
    """``(shape, strides, axis)`` of ``src`` coalesced, where ``axis`` (not the last) is the one whose
    elements are adjacent in memory — the view is a transpose — or None when copying ``src`` into a
    row-major array already reads it along its smallest stride (plain ``np.copyto`` is right)."""
    shape, strides = _coalesced(src.shape, src.strides)
    if len(shape) < 2 or any(s <= 0 for s in strides):
        return None
    axis = min(range(len(shape)), key=lambda d: strides[d])
    if axis == len(shape) - 1 or strides[-1] <= strides[axis]:
        return None
    return shape, strides, axis


def _tiled_2d(dst: np.ndarray, src: np.ndarray, casting: Casting) -> None:
    """``dst[...] = src`` for 2-D views where ``src``'s first axis is its contiguous one."""
    rows, cols = src.shape
    step = max(1, TILE_SOURCE_BYTES // src.itemsize)
    for r0 in range(0, rows, step):
        d, s = dst[r0 : r0 + step], src[r0 : r0 + step]
        for c0 in range(0, cols, TILE_SOURCE_ROWS):
            np.copyto(d[:, c0 : c0 + TILE_SOURCE_ROWS], s[:, c0 : c0 + TILE_SOURCE_ROWS], casting=casting)


def copy_into(dst: np.ndarray, src: np.ndarray, casting: Casting = "unsafe") -> None:
    """``np.copyto(dst, src, casting=casting)`` into a C-contiguous ``dst``, tile by tile when ``src``
    is a transposed view (see the module docstring); any other copy is one ``np.copyto``."""
    found = transposed_axis(src) if dst.flags.c_contiguous and src.size >= MIN_TILED_ELEMENTS else None
    if found is None or dst.shape != src.shape:
        np.copyto(dst, src, casting=casting)
        return
    shape, strides, axis = found
    if shape[axis] * shape[-1] < MIN_TILED_ELEMENTS:  # many small transposes: one call does them all
        np.copyto(dst, src, casting=casting)
        return
    if XLA_TRANSPOSE and _xla_copy(dst, src, casting):
        return
    src_c = np.lib.stride_tricks.as_strided(src, shape, strides, writeable=False)
    dst_c = dst.reshape(shape)
    # Put the contiguous source axis next to last; every other axis is looped over here.
    order = [d for d in range(len(shape)) if d not in (axis, len(shape) - 1)] + [axis, len(shape) - 1]
    src_c, dst_c = src_c.transpose(order), dst_c.transpose(order)
    for index in np.ndindex(*src_c.shape[:-2]):
        _tiled_2d(dst_c[index], src_c[index], casting)


@functools.cache
def _host_device() -> jax.Device | None:
    """JAX's first CPU device, or None where the CPU backend is not initialised (``JAX_PLATFORMS``)."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None


def _xla_device(src: np.ndarray) -> jax.Device | None:
    """The CPU device whose XLA transpose can copy ``src``: None where there is no CPU backend or
    JAX would not hold ``src``'s dtype exactly (float64 without x64)."""
    device = _host_device()
    return device if device is not None and jax.dtypes.canonicalize_dtype(src.dtype) == src.dtype else None


def _xla_copy(dst: np.ndarray, src: np.ndarray, casting: Casting) -> bool:
    """``dst[...] = src`` through XLA's host transpose, in pieces along the first axis; False (nothing
    copied) where :func:`_xla_device` has none."""
    device = _xla_device(src)
    if device is None:
        return False
    rows = max(1, XLA_PIECE_BYTES // max(1, src.nbytes // max(1, src.shape[0])))
    for r0 in range(0, src.shape[0], rows):
        piece = to_host_device(src[r0 : r0 + rows], device)
        np.copyto(dst[r0 : r0 + rows], np.asarray(piece), casting=casting)
        del piece  # its buffer goes back before the next piece asks for one
    return True


def xla_copies(src: np.ndarray, dtype: np.dtype, sharding: jax.sharding.Sharding) -> bool:
    """Whether ``src``, a shard's values, is best placed as it is — a transposed view of ``dtype``
    (no cast) large enough for :func:`copy_into` to tile, for CPU devices, which copy it with XLA's
    host transpose — rather than copied into a buffer of ours first."""
    if not XLA_TRANSPOSE or src.dtype != dtype or src.size < MIN_TILED_ELEMENTS or transposed_axis(src) is None:
        return False
    devices: set[jax.Device] = sharding.device_set
    on_cpu = all(device.platform == "cpu" for device in devices)
    return on_cpu and _xla_device(src) is not None
