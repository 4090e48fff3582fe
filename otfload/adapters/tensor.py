"""A base weight with LoRA deltas merged in, box by box.

:class:`AdaptedTensor` replaces a base entry of the checkpoint index (a stored tensor, or a
:class:`~otfload.index.quant.QuantizedTensor`) under the same name and shape; it is a
:class:`~otfload.index.derived.DerivedTensor`, so the planner, hooks, stacking and sharding treat it
like any tensor and only the reader looks inside. For the box a device needs it reads the base's box
(``base`` or ``base.<role>`` parts), and for each :class:`LoraTerm` the rows of ``A`` and ``B`` the
box needs (``lora{i}.A``: the box's input columns; ``lora{i}.B``: the box's output rows), then

    value = base[box] (float32) + Σ_i s_i · B_i[box rows] @ A_i[:, box cols]

in float32: nothing larger than the box is materialised, and the delta of rows or columns no local
device holds is never computed.

Orientation (PEFT's ``get_delta_weight``): for a ``Linear`` (``[out, in]``) and for fused expert
parameters stored ``[E, out, in]``, ``delta[p, q] = Σ_k B[p, k] A[k, q]``; for an ``Embedding``
(``[vocab, hidden]``, factors ``lora_embedding_A [r, vocab]``, ``lora_embedding_B [hidden, r]``) and
expert parameters stored ``[E, in, out]`` (GPT-OSS), the delta is transposed:
``delta[p, q] = Σ_k A[k, p] B[q, k]``. PEFT's fused expert factors (``target_parameters``) hold all
experts: ``A [E·r, in]`` grouped expert-major (row ``e·r + k``), ``B [out, r·E]`` grouped rank-major
(column ``k·E + e``) — from PEFT's ``ParamWrapper.get_delta_weight``
(``B.reshape(out, r, E)``, ``A.reshape(E, r, in)``, ``einsum("ore,eri->eoi")``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from otfload.index.derived import Box, DerivedTensor, Parts, is_derived
from otfload.index.header import TensorInfo

FLOAT32 = np.dtype(np.float32)
BASE = "base"
# OpenBLAS multithreads a GEMM once m·n·k reaches 65536·4 (its SMP threshold); those threads then
# fight the builder's own worker threads (measured 10x slower on 2 busy cores). Rank-r products are
# computed in tiles under the threshold instead: single-threaded BLAS speed (~1 ns per output
# element at rank 16, 0.6 ms for 1408x512), whatever the machine's load.
SINGLE_THREAD_GEMM = 65536 * 4
TILE_COLS = 128


def low_rank_product(left: np.ndarray, right: np.ndarray, out: np.ndarray) -> np.ndarray:
    """``out[:] = left @ right`` (``[m, r] @ [r, n]``) in tiles that BLAS runs on one thread."""
    rank = left.shape[1]
    tile_rows = max(1, (SINGLE_THREAD_GEMM - 1) // (TILE_COLS * max(rank, 1)))
    for i in range(0, left.shape[0], tile_rows):
        rows = slice(i, i + tile_rows)
        for j in range(0, right.shape[1], TILE_COLS):
            cols = slice(j, j + TILE_COLS)
            np.matmul(left[rows], right[:, cols], out=out[rows, cols])
    return out


@dataclass(frozen=True)
class LoraTerm:
    """One ``s·B@A`` delta on a 2-D weight (or on each expert of a 3-D expert stack).

    ``experts`` is the number of experts the factors hold (1 for a plain module). ``expert`` picks one
    of them when the base is one expert's 2-D weight (fused factors, per-expert checkpoint); with
    ``expert=None`` and ``experts > 1`` the base has a leading expert axis. ``out_offset`` is where the
    base's output rows start in ``B`` (gate and up share one fused ``B``).
    """

    a: TensorInfo
    b: TensorInfo
    rank: int
    scale: float
    transposed: bool = False
    experts: int = 1
    expert: int | None = None
    out_offset: int = 0

    def _experts_box(self, box: Box) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]]:
        """The experts the box covers and the box without its expert axis."""
        if self.experts > 1 and self.expert is None:
            return box[0], box[1:]
        e = 0 if self.expert is None else self.expert
        return (e, e + 1), box

    def part_boxes(self, box: Box) -> dict[str, tuple[TensorInfo, Box]]:
        (e0, e1), (rows, cols) = self._experts_box(box)
        out, inp = (cols, rows) if self.transposed else (rows, cols)
        a_rows = (e0 * self.rank, e1 * self.rank)
        b_rows = (self.out_offset + out[0], self.out_offset + out[1])
        return {"A": (self.a, (a_rows, inp)), "B": (self.b, (b_rows, (0, self.b.shape[1])))}

    def delta(self, a: np.ndarray, b: np.ndarray, box: Box) -> np.ndarray:
        """``s·B@A`` over ``box``, a fresh float32 array, from the part boxes read for it.

        BLAS products in tiles (:func:`low_rank_product`; ``einsum`` would loop in C without BLAS,
        2-3x slower); the scale multiplies the small ``A`` box, not the product."""
        (e0, e1), _ = self._experts_box(box)
        a = a.astype(FLOAT32) * np.float32(self.scale)
        a = a.reshape(e1 - e0, self.rank, a.shape[-1])  # [e, r, in]
        b = b.astype(FLOAT32, copy=False).reshape(b.shape[0], self.rank, self.experts)[:, :, e0:e1]  # [out, r, e]
        inp, out = a.shape[-1], b.shape[0]
        delta = np.empty((e1 - e0, *((inp, out) if self.transposed else (out, inp))), FLOAT32)
        for e in range(e1 - e0):
            if self.transposed:  # [in, r] @ [r, out]
                low_rank_product(a[e].T, b[:, :, e].T, delta[e])
            else:  # [out, r] @ [r, in]
                low_rank_product(b[:, :, e], a[e], delta[e])
        return delta if self.experts > 1 and self.expert is None else delta[0]


def _box_of(shape: tuple[int, ...]) -> Box:
    return tuple((0, d) for d in shape)


@dataclass(frozen=True)
class AdaptedTensor:
    """``base`` (a stored or quantized tensor) plus LoRA ``terms``, standing for the float32 tensor
    ``name`` of ``shape``; a :class:`~otfload.index.derived.DerivedTensor`."""

    base: TensorInfo | DerivedTensor
    terms: tuple[LoraTerm, ...]

    dtype = FLOAT32

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    @property
    def file(self) -> str:
        return self.base.file

    @property
    def nbytes(self) -> int:
        return sum(info.nbytes for info, _ in self.part_boxes(_box_of(self.shape)).values())

    @property
    def storage(self) -> str:
        base = self.base.storage if is_derived(self.base) else str(self.base.dtype)
        ranks = ", ".join(str(t.rank) for t in self.terms)
        return f"{base} + LoRA rank {ranks} (merged in float32)"

    def part_boxes(self, box: Box) -> Parts:
        """The base's box (roles ``base`` or ``base.<role>``) and each term's factor rows."""
        if is_derived(self.base):
            parts = {f"{BASE}.{role}": part for role, part in self.base.part_boxes(box).items()}
        else:
            parts = {BASE: (self.base, box)}
        for i, term in enumerate(self.terms):
            parts.update({f"lora{i}.{role}": part for role, part in term.part_boxes(box).items()})
        return parts

    def decode(self, arrays: dict[str, np.ndarray], box: Box) -> np.ndarray:
        """``base[box] + Σ s·B@A`` in float32: the deltas first (fresh buffers), then the base is
        added into them, widened on the fly (no float32 copy of the base box)."""
        values = self.terms[0].delta(arrays["lora0.A"], arrays["lora0.B"], box)
        for i, term in enumerate(self.terms[1:], 1):
            values += term.delta(arrays[f"lora{i}.A"], arrays[f"lora{i}.B"], box)
        if is_derived(self.base):
            prefix = f"{BASE}."
            base = self.base.decode({k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}, box)
        else:
            base = arrays[BASE]
        np.add(values, base, out=values)
        return values


__all__ = ["AdaptedTensor", "LoraTerm"]
