"""Quantized copies of the tiny checkpoints, each made once per test module, in the layouts a table
names: the factory of tests/test_quantized.py and tests/families/test_hybrid_quantized.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

from tests.index.quant import layouts

# name -> (tiny model kind, tensor selector, quantizer, quantization config or side file)
Layouts = Mapping[str, tuple[str, Callable[[str], bool], layouts.Quantizer, Any]]


class QuantizedCheckpoint(NamedTuple):
    path: Path  # the quantized checkpoint
    torch_model: Any  # transformers' float model of the tiny checkpoint it was made from
    reference_model: Any  # transformers' float32 model of the exactly dequantised weights
    reference: dict[str, np.ndarray]  # HF key -> dequantised float32 value of every quantized tensor


def quantized_factory(
    tiny_checkpoints: Callable[[str], tuple[Path, Any]],
    tmp_path_factory: pytest.TempPathFactory,
    table: Layouts,
    finish: Callable[[str, Path], None] = lambda layout, path: None,
) -> Callable[[str], QuantizedCheckpoint]:
    """``get(layout) -> QuantizedCheckpoint``, each layout of ``table`` made on first use; ``finish(layout,
    path)`` edits the quantized checkpoint before its reference model is built."""
    made: dict[str, QuantizedCheckpoint] = {}

    def get(layout: str) -> QuantizedCheckpoint:
        if layout not in made:
            kind, select, quantize, config = table[layout]
            src, torch_model = tiny_checkpoints(kind)
            dst = tmp_path_factory.mktemp(layout) / "ckpt"
            reference = layouts.quantize_checkpoint(src, dst, select, quantize, config)
            assert reference, f"{layout}: no tensor was quantized"
            finish(layout, dst)
            ref_model = layouts.load_reference(torch_model, reference, src, dst.parent / "reference")
            made[layout] = QuantizedCheckpoint(dst, torch_model, ref_model, reference)
        return made[layout]

    return get
