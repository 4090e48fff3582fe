"""The checkpoint's tensors as the model sees them: which quantization method a checkpoint uses
(from ``quantization_config``, or ModelOpt's ``hf_quant_config.json``) and its weights decoded on read.

:func:`dequantized_view` turns the index's tensors into the tensors the model wants: the method's
decoder (:data:`~otfload.index.quant.methods.METHODS`) replaces every stored quantized weight by
one :class:`~otfload.index.quant.tensor.QuantizedTensor` under the dequantised parameter's name,
and activation-side tensors (``input_scale``, ``k_scale``, ...) move aside for the load report.

Never silently wrong: an unknown ``quant_method``, a scale or zero point no rule explains, or a
scale whose shape does not fit its weight is a :class:`~otfload.errors.QuantizationError` whatever
``strict`` says — dropping a scale as "unexpected" would load raw codes as weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otfload.errors import ConfigError, QuantizationError, UnsupportedQuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail
from otfload.index.quant.methods import METHODS, NOT_YET_SUPPORTED
from otfload.index.quant.methods.fp8 import legacy_fp8
from otfload.index.quant.methods.modelopt import HF_QUANT_CONFIG

# Tensors that belong to a quantized weight; one left over after decoding is an error. Gemma 4's
# router.per_expert_scale and DeepSeek-V4's hyper-connection scales (hc_attn_scale, hc_ffn_scale,
# hc_head_scale, hc_head.hc_scale) are model parameters, not scales.
COMPANION = re.compile(
    r"(_scale_inv|(?<!\.per_expert)(?<!hc_attn)(?<!hc_ffn)(?<!hc_head)(?<!\.hc)_scale"
    r"|_scale_2|_scales|_zero_point|_blocks|_packed|_shape|_g_idx"
    r"|\.qweight|\.qzeros|\.g_idx|\.SCB|\.absmax|\.quant_map|\.quant_state\..*)$"
)
# Scales of activations and the KV cache: reported, never folded into weights.
ACTIVATION = re.compile(
    r"\.(input_scale|input_global_scale|input_zero_point|output_scale|output_zero_point|"
    r"k_scale|v_scale|q_scale|kv_scale|activation_scale|input_scale_ub)$"
)


@dataclass
class QuantizedView:
    """The index's tensors with every quantized weight decoded, plus the activation-side tensors."""

    tensors: dict[str, Tensor]
    method: str | None = None
    activation: dict[str, TensorInfo] = field(default_factory=dict)


def _quantization_config(config: Mapping[str, Any], hf_quant: object) -> tuple[str, object]:
    """Where the checkpoint's ``quantization_config`` is and its value: at the top, else in
    ``text_config`` (multimodal wrappers such as Kimi-K2.5 quantize only their language model), else
    ModelOpt's ``hf_quant_config.json`` (``hf_quant``, None when the checkpoint has none)."""
    if config.get("quantization_config") is not None:
        return "quantization_config", config["quantization_config"]
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get("quantization_config") is not None:
        return "text_config.quantization_config", text["quantization_config"]
    if hf_quant is not None:
        if not isinstance(hf_quant, Mapping):
            raise ConfigError(HF_QUANT_CONFIG, hf_quant, "an object", file=HF_QUANT_CONFIG)
        return HF_QUANT_CONFIG, {"quant_method": "modelopt", **hf_quant}
    return "quantization_config", None


def quantization_method(config: Mapping[str, Any], hf_quant: object = None) -> tuple[str | None, QuantConfig]:
    """``quantization_config.quant_method`` and the config itself, type-checked (``hf_quant``: the
    parsed ``hf_quant_config.json`` of a ModelOpt export, used when ``config.json`` has no
    ``quantization_config``)."""
    where, qc = _quantization_config(config, hf_quant)
    if qc is None:
        return None, {}
    if not isinstance(qc, Mapping):
        raise ConfigError(where, qc, "an object with a 'quant_method'")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(f"{where}.quant_method", method, "a string")
    method = method.lower()
    if method in NOT_YET_SUPPORTED:
        raise UnsupportedQuantizationError(f"quantization method {method!r} is not supported yet "
                                           f"(supported: {', '.join(sorted(METHODS))})")
    if method not in METHODS:
        raise QuantizationError(f"unknown quantization method {method!r} (supported: {', '.join(sorted(METHODS))})")
    return method, qc


def dequantized_view(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo], read: ReadValues,
                     hf_quant: object = None) -> QuantizedView:
    """The checkpoint's tensors as the model sees them: quantized weights decoded on read.

    ``read`` returns the values of small tensors (compressed-tensors' ``weight_shape``);
    ``hf_quant`` is the parsed ``hf_quant_config.json`` of a ModelOpt export, if it has one.
    """
    method, qc = quantization_method(config, hf_quant)
    activation = {k: v for k, v in tensors.items() if ACTIVATION.search(k)}
    work: dict[str, Tensor] = {k: v for k, v in tensors.items() if k not in activation}
    if method is None:
        legacy_fp8(work)
    else:
        METHODS[method](qc, work, read)
    leftover = sorted(k for k, v in work.items() if isinstance(v, TensorInfo) and COMPANION.search(k))
    if leftover:
        more = f" and {len(leftover) - 5} more" if len(leftover) > 5 else ""
        shown = ", ".join(repr(k) for k in leftover[:5]) + more
        hint = ""
        if method is None and any(k.endswith(".weight_scale") for k in leftover):
            hint = (f" (an NVIDIA ModelOpt export describes its weight_scale tensors in {HF_QUANT_CONFIG} "
                    "beside config.json: is it missing?)")
        raise fail(method, f"{len(leftover)} quantization tensor(s) that no known layout explains: {shown}{hint}")
    return QuantizedView(work, method, activation)
