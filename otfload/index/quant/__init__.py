"""Quantized checkpoints: which layout stores each weight, and how a box of it is decoded."""

from otfload.index.quant.formats import QuantizedView, dequantized_view
from otfload.index.quant.tensor import QuantizedTensor

__all__ = ["QuantizedTensor", "QuantizedView", "dequantized_view"]
