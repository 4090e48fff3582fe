"""The codecs of quantized checkpoints: how one stored number becomes a float32, in one registry.

A codec maps stored values — one per element (``cast``, ``e8m0``), or bit fields unpacked from wider
words (``int``, ``e2m1``) — to float32. Each module here holds one codec's two decoders side by
side, with the same arithmetic so that they give the same bits: ``numpy``, used while reading (the
default ``quantized="dequantize"``: :meth:`~otfload.index.quant.tensor.QuantizedTensor.decode`),
and ``jax``, used on the devices inside a jitted model (``quantized="keep"``:
:func:`otfload.quantized.dequantize`).

Adding a codec: one module here with both decoders and its :class:`~.codec.Codec`, listed in
:data:`CODECS`; the quantization methods that store such codes (:mod:`otfload.index.quant.methods`)
name it by its key.
"""

from otfload.index.quant.codecs import cast, e2m1, e8m0, packed_int
from otfload.index.quant.codecs.codec import Codec

CODECS: dict[str, Codec] = {codec.name: codec for codec in (cast.CODEC, e8m0.CODEC, e2m1.CODEC, packed_int.CODEC)}

__all__ = ["CODECS", "Codec"]
