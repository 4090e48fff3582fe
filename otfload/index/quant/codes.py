"""Decoders of packed low-precision codes, written from the format descriptions (pure numpy).

- FP4 E2M1 (MXFP4, NVFP4): 4-bit codes, sign bit 3, values ``0, .5, 1, 1.5, 2, 3, 4, 6``; two codes
  per byte, the **low nibble first** (element ``2i`` in bits 0-3 of byte ``i``).
- E8M0 (MXFP4 block scales): one byte ``s`` is ``2**(s - 127)``; ``s = 255`` is NaN.
- Dense b-bit integers (compressed-tensors ``pack-quantized``, GPTQ): the elements of a row are one
  little-endian bit stream of int32 words, element ``i`` at bits ``[i*b, (i+1)*b)``, stored with an
  offset of ``2**(b-1)`` (so ``code - 2**(b-1)`` is the signed value; GPTQ's unsigned codes and
  zero points carry the same offset, which cancels in ``code - zero``).
- AWQ interleaves the 8 int4 fields of each word: element ``j`` of a word is field ``order[j]``
  (``order`` = ``(0, 4, 1, 5, 2, 6, 3, 7)``, the inverse of AutoAWQ's pack order ``0 2 4 6 1 3 5 7``).
"""

from __future__ import annotations

import numpy as np

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32
)
E8M0_BIAS = 127
E8M0_NAN = 255
BITS_PER_WORD = 32


def fp4_values(packed: np.ndarray) -> np.ndarray:
    """Float32 values of FP4 E2M1 codes packed two per byte; the last axis doubles."""
    packed = np.asarray(packed, np.uint8)
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), np.float32)
    out[..., 0::2] = E2M1_VALUES[packed & 0x0F]
    out[..., 1::2] = E2M1_VALUES[packed >> 4]
    return out


def e8m0_values(scales: np.ndarray) -> np.ndarray:
    """Float32 values of E8M0 scale bytes (``2**(s - 127)``, NaN for 255)."""
    s = np.asarray(scales, np.uint8)
    exponent = np.where(s == E8M0_NAN, 0, s.astype(np.int32) - E8M0_BIAS)
    out = np.ldexp(np.float32(1.0), exponent).astype(np.float32)
    out[s == E8M0_NAN] = np.nan
    return out


def packed_words(start: int, stop: int, num_bits: int) -> tuple[int, int]:
    """The int32 words holding elements ``[start, stop)`` of a row packed at ``num_bits`` each."""
    return start * num_bits // BITS_PER_WORD, -(-stop * num_bits // BITS_PER_WORD)


def unpack_rows(words: np.ndarray, num_bits: int, start: int, stop: int,
                order: tuple[int, ...] | None = None) -> np.ndarray:
    """:func:`unpack_ints` along axis -2: each word of ``words`` ``[..., words, columns]`` packs
    ``num_bits``-bit fields of consecutive rows (AWQ's codes, zero points); element ``j`` of a word
    is its field ``order[j]`` (default ``j``). The rows come out C-contiguous: each field is shifted
    out of every word at once into its row (one pass per field, no transposed copy of the output).
    """
    if BITS_PER_WORD % num_bits:  # fields straddle words: one bit stream per column
        if order is not None:
            raise ValueError(f"an interleave order needs fields that tile a word, not {num_bits}-bit ones")
        return np.swapaxes(unpack_ints(np.swapaxes(words, -1, -2), num_bits, start, stop), -1, -2)
    per = BITS_PER_WORD // num_bits
    fields = np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint32)
    *lead, count, columns = fields.shape
    out = np.empty((*lead, count, per, columns), np.float32)
    mask = np.uint32((1 << num_bits) - 1)
    for k in range(per):
        element = k if order is None else order.index(k)
        np.bitwise_and(fields >> np.uint32(k * num_bits), mask, out=out[..., element, :], casting="unsafe")
    out -= 1 << (num_bits - 1)
    first = start // per * per
    return out.reshape(*lead, count * per, columns)[..., start - first : stop - first, :]


def unpack_ints(words: np.ndarray, num_bits: int, start: int, stop: int) -> np.ndarray:
    """Signed values (as float32) of elements ``[start, stop)`` along the last axis, from the words
    covering them (``words`` starts at word ``packed_words(start, stop, num_bits)[0]`` of each row).

    Codes are written straight into the float32 result and the offset subtracted in place: one pass
    over the output instead of widening through int32 (3x faster for int4, measured).
    """
    data = np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint8)
    first_word = start * num_bits // BITS_PER_WORD
    skip = start * num_bits - first_word * BITS_PER_WORD
    n = stop - start
    if num_bits == 8:
        out = data[..., skip // 8 : skip // 8 + n].astype(np.float32)
    elif num_bits == 4:
        both = np.empty((*data.shape[:-1], data.shape[-1] * 2), np.float32)
        np.bitwise_and(data, 0x0F, out=both[..., 0::2], casting="unsafe")
        np.right_shift(data, 4, out=both[..., 1::2], casting="unsafe")
        out = both[..., skip // 4 : skip // 4 + n]
    else:
        bits = np.unpackbits(data, axis=-1, bitorder="little")[..., skip : skip + n * num_bits]
        weights = (1 << np.arange(num_bits, dtype=np.int32)).astype(np.int32)
        out = (bits.reshape(*bits.shape[:-1], n, num_bits).astype(np.int32) @ weights).astype(np.float32)
    out -= 1 << (num_bits - 1)
    return out
