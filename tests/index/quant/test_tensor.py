"""Decoding a box of a quantized tensor reads only the part boxes covering it and equals the same
box of the whole tensor decoded by the format's reference (numpy from the description, or the
package that writes the format)."""

import itertools

import numpy as np
import pytest
import torch

from otfload.errors import QuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.codes import Mxfp4Codes, PackedIntCodes, PlainCodes
from otfload.index.quant.scales import BlockScales
from otfload.index.quant.tensor import QuantizedTensor
from tests.index.quant import layouts
from tests.index.quant.layouts import mxfp4_pack


def info(name: str, array: np.ndarray) -> TensorInfo:
    return TensorInfo(name, array.dtype, array.shape, "f", 0, array.nbytes)


def decode_box(tensor: QuantizedTensor, arrays: dict[str, np.ndarray], box) -> np.ndarray:
    parts = tensor.part_boxes(box)
    return tensor.decode({role: arrays[role][tuple(slice(a, b) for a, b in pbox)]
                          for role, (_, pbox) in parts.items()}, box)


def boxes(shape, cuts):
    """Boxes from cutting each axis at ``cuts`` (fractions), including unaligned edges."""
    per_axis = [sorted({0, d, *(int(d * c) for c in cuts)}) for d in shape]
    yield from itertools.product(*[list(zip(e, e[1:], strict=False)) for e in per_axis])


def test_int8_with_zero_points_per_group_equals_numpy_reference():
    rng = np.random.default_rng(0)
    q = rng.integers(-128, 128, (12, 40), dtype=np.int8)
    scale = rng.random((12, 5)).astype(np.float32)
    zero = rng.integers(-4, 4, (12, 5), dtype=np.int8)
    tensor = QuantizedTensor("w", (12, 40), PlainCodes(info("q", q)),
                             BlockScales(info("s", scale), (1, 8), info("z", zero)), "int8")
    want = (q.astype(np.float32) - np.repeat(zero, 8, 1)) * np.repeat(scale, 8, 1)
    arrays = {"codes": q, "scale": scale, "zero_point": zero}
    for box in boxes(q.shape, (0.3, 0.55)):
        np.testing.assert_array_equal(decode_box(tensor, arrays, box), want[tuple(slice(a, b) for a, b in box)])


@pytest.mark.parametrize("num_bits", [3, 4, 8])
def test_packed_asymmetric_group_equals_compressed_tensors(num_bits):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    gen = torch.Generator().manual_seed(num_bits)
    lo, hi = -(2 ** (num_bits - 1)), 2 ** (num_bits - 1)
    q = torch.randint(lo, hi, (20, 64), dtype=torch.int8, generator=gen)
    zero = torch.randint(lo, hi, (20, 4), dtype=torch.int8, generator=gen)
    scale = torch.rand(20, 4, generator=gen)
    packed, packed_zero = pack_to_int32(q, num_bits), pack_to_int32(zero, num_bits, packed_dim=0)
    zero_back = unpack_from_int32(packed_zero, num_bits, torch.Size((20, 4)), packed_dim=0)
    want = ((q.float() - zero_back.float().repeat_interleave(16, 1)) * scale.repeat_interleave(16, 1)).numpy()
    arrays = {"codes": packed.numpy(), "scale": scale.numpy(), "zero_point": packed_zero.numpy()}
    scales = BlockScales(info("s", arrays["scale"]), (1, 16), info("z", arrays["zero_point"]), num_bits)
    tensor = QuantizedTensor("w", (20, 64), PackedIntCodes(info("p", arrays["codes"]), num_bits), scales, "int")
    for box in boxes((20, 64), (0.25, 0.6)):
        np.testing.assert_array_equal(decode_box(tensor, arrays, box), want[tuple(slice(a, b) for a, b in box)])


def test_mxfp4_boxes_equal_transformers_dequantisation():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    w = torch.randn(3, 96, 40)  # [E, in, out]
    blocks, scales = mxfp4_pack(w)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).numpy()
    arrays = {"blocks": blocks.numpy(), "scales": scales.numpy()}
    tensor = QuantizedTensor("w", (3, 96, 40), Mxfp4Codes(info("b", arrays["blocks"]), info("s", arrays["scales"])),
                             None, "mxfp4")
    for box in boxes((3, 96, 40), (0.4, 0.7)):
        np.testing.assert_array_equal(decode_box(tensor, arrays, box), want[tuple(slice(a, b) for a, b in box)])
    # Quantization error of MXFP4 is bounded: one e2m1 step at the block's scale.
    assert np.abs(want - w.numpy()).max() <= np.abs(w.numpy()).max() / 2


def test_part_boxes_read_only_what_the_box_needs():
    packed = np.zeros((20, 8), np.int32)  # 64 int4 values per row
    scale = np.zeros((20, 4), np.float32)
    tensor = QuantizedTensor("w", (20, 64), PackedIntCodes(info("p", packed), 4),
                             BlockScales(info("s", scale), (1, 16)), "int4")
    parts = tensor.part_boxes(((5, 10), (17, 33)))
    assert parts["codes"][1] == ((5, 10), (2, 5))  # words 2..4 hold elements 16..39
    assert parts["scale"][1] == ((5, 10), (1, 3))


@pytest.mark.parametrize(("bits", "group", "desc_act", "fmt"), [
    (4, 16, False, "gptq"), (8, 16, False, "gptq_v2"), (2, 32, False, "gptq"), (4, -1, False, "gptq_v2"),
    (4, 16, True, "gptq"), (2, 16, True, "gptq_v2"), (8, 32, True, "gptq"),
])
def test_gptq_boxes_equal_the_numpy_reference(bits, group, desc_act, fmt):
    from otfload.index.quant.methods.intlinear import gptq

    config = layouts.gptq_config(bits, group, desc_act=desc_act, sym=False, fmt=fmt)
    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(bits))
    stored, want = layouts.gptq(config)("m.weight", w)
    tensors = {k: info(k, v.numpy()) for k, v in stored.items()}
    gptq(config, tensors, lambda infos: [])
    tensor = tensors["m.weight"]
    assert set(tensors) == {"m.weight"} and tensor.shape == (48, 64)
    roles = {"codes": "qweight", "scale": "scales", "zero_point": "qzeros", "g_idx": "g_idx"}
    arrays = {role: stored[f"m.{name}"].numpy() for role, name in roles.items()}
    for box in boxes((48, 64), (0.3, 0.55)):
        np.testing.assert_array_equal(decode_box(tensor, arrays, box), want.numpy()[tuple(slice(a, b) for a, b in box)])
    # the codes are what the weight says: within half a quantization step of it, per group
    assert np.abs(want.numpy() - w.numpy()).max() <= np.abs(w.numpy()).max() / (2**bits - 1) * 1.01


def test_gptq_desc_act_reads_each_column_group_from_g_idx():
    from otfload.index.quant.methods.intlinear import gptq

    config = layouts.gptq_config(4, 16, desc_act=True, sym=False)
    stored, _ = layouts.gptq(config)("m.weight", torch.randn(48, 64))
    tensors = {k: info(k, v.numpy()) for k, v in stored.items()}
    gptq(config, tensors, lambda infos: [])
    parts = tensors["m.weight"].part_boxes(((8, 16), (10, 20)))
    assert parts["g_idx"][1] == ((10, 20),) and parts["scale"][1] == ((0, 4), (8, 16))  # every group, box rows
    arrays = {"codes": stored["m.qweight"].numpy(), "scale": stored["m.scales"].numpy(),
              "zero_point": stored["m.qzeros"].numpy(), "g_idx": np.full(64, 4, np.int32)}
    with pytest.raises(QuantizationError, match="'m.g_idx'\\[0\\] = 4: a group outside \\[0, 4\\)"):
        decode_box(tensors["m.weight"], arrays, ((0, 8), (0, 64)))


def test_awq_boxes_equal_the_numpy_reference():
    from otfload.index.quant.methods.intlinear import awq

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    stored, want = layouts.awq("m.weight", w)
    tensors = {k: info(k, v.numpy()) for k, v in stored.items()}
    awq(layouts.AWQ_CONFIG, tensors, lambda infos: [])
    tensor = tensors["m.weight"]
    arrays = {"codes": stored["m.qweight"].numpy(), "scale": stored["m.scales"].numpy(),
              "zero_point": stored["m.qzeros"].numpy()}
    assert tensor.part_boxes(((9, 17), (5, 40)))["codes"][1] == ((5, 40), (1, 3))  # words of rows 8..23
    for box in boxes((48, 64), (0.3, 0.55)):
        np.testing.assert_array_equal(decode_box(tensor, arrays, box), want.numpy()[tuple(slice(a, b) for a, b in box)])
