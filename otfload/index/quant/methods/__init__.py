"""The quantization methods otfload decodes, one module each, in one registry: ``quant_method`` ->
the function that finds its quantized weights among a checkpoint's tensors.

Each method rewrites the tensor map in place: every stored quantized weight (codes plus scales,
zero points, global scales) becomes one :class:`~otfload.index.quant.tensor.QuantizedTensor` under
the dequantised parameter's name, built from the layouts of :mod:`~otfload.index.quant.codes` and
:mod:`~otfload.index.quant.scales`. The layout of each weight is decided by the tensors present;
the config supplies the parameters (bits, strategy, group and block sizes) and is cross-checked
against them. :mod:`otfload.index.quant.view` picks the method and checks that nothing is left over.

Methods (docs/formats.md has the math and the references each was checked against):

- ``fp8`` (DeepSeek-V3, Qwen3-FP8, Ministral) and ``fbgemm_fp8``: :mod:`~.fp8`;
- ``compressed-tensors`` (float/int-quantized, pack-quantized, NVFP4): :mod:`~.compressed_tensors`;
- ``mxfp4`` (GPT-OSS): :mod:`~.mxfp4`;
- ``gptq`` and ``awq``: :mod:`~.intlinear`;
- ``modelopt`` (NVIDIA ModelOpt FP8 and NVFP4): :mod:`~.modelopt`.

Adding a method: one module here, listed in :data:`METHODS`.
"""

from __future__ import annotations

from otfload.index.quant.common import Method
from otfload.index.quant.methods.compressed_tensors import compressed_tensors
from otfload.index.quant.methods.fp8 import fbgemm_fp8, fp8
from otfload.index.quant.methods.intlinear import awq, gptq
from otfload.index.quant.methods.modelopt import modelopt
from otfload.index.quant.methods.mxfp4 import mxfp4

METHODS: dict[str, Method] = {
    "awq": awq,
    "gptq": gptq,
    "fp8": fp8,
    "modelopt": modelopt,
    "fbgemm_fp8": fbgemm_fp8,
    "mxfp4": mxfp4,
    "compressed-tensors": compressed_tensors,
}
# Methods transformers knows that otfload detects but does not decode yet.
NOT_YET_SUPPORTED = frozenset({
    "bitsandbytes", "aqlm", "eetq", "hqq", "quanto", "torchao", "exl2", "higgs",
    "vptq", "spqr", "bitnet", "fp_quant", "auto-round", "quark", "fbgemm_fp4", "mxfp8",
})
