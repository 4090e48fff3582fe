"""Packed-code decoders against the packages that write those codes (compressed-tensors,
transformers), on column ranges that start and end inside words and bytes; and every codec's
numpy and JAX decoders against each other, on every value it can store."""

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

from otfload.index.quant.codecs import CODECS
from otfload.index.quant.codecs.e2m1 import E2M1_VALUES, fp4_values
from otfload.index.quant.codecs.e8m0 import e8m0_values
from otfload.index.quant.codecs.packed_int import packed_words, unpack_ints


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


def _every_value(name: str, bits: int) -> np.ndarray:
    """Every value a codec's decoder can be given: all bytes of one-byte dtypes, all fields."""
    if name == "cast":
        return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    if name == "e8m0":
        return np.arange(256, dtype=np.uint8)
    return np.arange(2**bits, dtype=np.uint32)


@pytest.mark.parametrize(("name", "bits", "add"), [("cast", 0, 0), ("cast", 0, 1), ("e8m0", 0, 0), ("e2m1", 4, 0),
                                                    *(("int", b, add) for b in (2, 4, 8) for add in (0, 1))])
def test_host_and_device_decoders_of_a_codec_agree_on_every_value(name, bits, add):
    codec = CODECS[name]
    values = _every_value(name, bits)
    host = codec.numpy(values.copy(), bits, add)
    device = np.asarray(codec.jax(jnp.asarray(values), bits, add))
    assert host.dtype == device.dtype == np.float32
    np.testing.assert_array_equal(host, device)  # NaN where the other has NaN
    finite = ~np.isnan(host)
    np.testing.assert_array_equal(np.signbit(host[finite]), np.signbit(device[finite]))  # -0.0 stays -0.0
