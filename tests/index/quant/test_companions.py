"""A companion tensor (scale, zero point, packed codes) is read as stored, never as a decoded weight:
a hostile checkpoint whose names make one tensor both (``w_scale_inv`` is the FP8 weight of
``w_scale_inv_scale_inv`` *and* the scale of ``w``) is a typed error naming it, not a crash."""

import numpy as np
import pytest

from otfload.errors import QuantizationError
from tests.index.quant.test_methods import checkpoint, w8


def test_a_tensor_that_is_both_a_weight_and_a_scale_is_a_quantization_error(tmp_path):
    tensors = {"a.weight": w8(), "a.weight_scale_inv": w8(),
               "a.weight_scale_inv_scale_inv": np.ones((1, 1), np.float32)}
    with pytest.raises(QuantizationError, match="'a.weight_scale_inv' is both a decoded weight and a companion"):
        checkpoint(tmp_path, tensors, {"quant_method": "fp8", "weight_block_size": [128, 128]})
