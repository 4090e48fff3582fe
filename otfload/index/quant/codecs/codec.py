"""What a codec is: a name and two decoders, one for the host and one for the devices."""

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
    :class:`~otfload.index.quant.parts.StoredPart`. A packed codec's values are bit fields of wider
    words, unpacked first: by :func:`~otfload.index.quant.codecs.fields.unpack_fields` on the
    devices, in the codec's own module (fused with the decode) on the host.
    """

    name: str
    numpy: HostDecoder
    jax: DeviceDecoder
