"""Quantized checkpoints: which method stores each weight (:mod:`~.methods`), how its codes and scales
are laid out (:mod:`~.codes`, :mod:`~.scales`), how a stored number decodes (:mod:`~.codecs`: numpy
and JAX side by side), and how a box of it is decoded on read (:class:`QuantizedTensor`)."""

from otfload.index.quant.tensor import QuantizedTensor
from otfload.index.quant.view import QuantizedView, dequantized_view

__all__ = ["QuantizedTensor", "QuantizedView", "dequantized_view"]
