"""Packed-code decoders against the packages that write those codes (compressed-tensors,
transformers), on column ranges that start and end inside words and bytes."""

import numpy as np
import pytest
import torch

from otfload.index.quant.codes import E2M1_VALUES, e8m0_values, fp4_values, packed_words, unpack_ints


def test_e2m1_table_is_transformers_table():
    from transformers.integrations.mxfp4 import FP4_VALUES

    np.testing.assert_array_equal(E2M1_VALUES, np.array(FP4_VALUES, np.float32))


def test_fp4_values_match_compressed_tensors_unpack():
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

    packed = np.random.default_rng(0).integers(0, 256, (6, 10), dtype=np.uint8)
    want = unpack_fp4_from_uint8(torch.from_numpy(packed), 6, 20, dtype=torch.float32).numpy()
    np.testing.assert_array_equal(fp4_values(packed), want)


def test_e8m0_is_a_power_of_two_and_255_is_nan():
    got = e8m0_values(np.array([0, 1, 126, 127, 128, 254, 255], np.uint8))
    np.testing.assert_array_equal(got[:-1], np.ldexp(np.float32(1), np.array([-127, -126, -1, 0, 1, 127])))
    assert np.isnan(got[-1])


@pytest.mark.parametrize("num_bits", range(1, 9))
@pytest.mark.parametrize(("start", "stop"), [(0, 70), (3, 41), (31, 33), (64, 70), (5, 6)])
def test_unpack_ints_matches_compressed_tensors(num_bits, start, stop):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    lo, hi = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1)
    values = torch.randint(lo, hi, (5, 70), dtype=torch.int8, generator=torch.Generator().manual_seed(num_bits))
    packed = pack_to_int32(values, num_bits)
    want = unpack_from_int32(packed, num_bits, torch.Size((5, 70))).numpy()[:, start:stop]
    w0, w1 = packed_words(start, stop, num_bits)
    got = unpack_ints(packed.numpy()[:, w0:w1], num_bits, start, stop)
    np.testing.assert_array_equal(got, want)
