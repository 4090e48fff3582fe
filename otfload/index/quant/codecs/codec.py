"""What a codec is: a name, whether its values are packed bit fields, and two decoders."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import numpy as np

# ``(values, bits, add) -> float32``: the stored values (or unpacked fields), the field width of a
# packed codec (0 otherwise), and an integer added to every value (GPTQ v1 zero points).
HostDecoder = Callable[[np.ndarray, int, int], np.ndarray]
DeviceDecoder = Callable[[jax.Array, int, int], jax.Array]


@dataclass(frozen=True)
class Codec:
    """One encoding of stored numbers and its host (numpy) and device (JAX) decoders.

    ``name`` is its key in :data:`~otfload.index.quant.codecs.CODECS`, recorded in every
    :class:`~otfload.index.quant.parts.StoredPart`; ``packed``: its values are bit fields packed
    into wider words (unpacked first: :func:`~otfload.index.quant.codecs.fields.unpack_fields`
    on the devices, fused into the codec's own numpy unpacking on the host).
    """

    name: str
    packed: bool
    numpy: HostDecoder
    jax: DeviceDecoder
