"""The quantized stages: ``quantized="keep"`` (weights kept packed on the devices) and the
activation scales a checkpoint stores beside its weights (FP8 static activation quantization)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from otfload.accounting.meter import FetchMeter, metering
from otfload.index.checkpoint import read_values
from otfload.plan.keep import assemble_kept, keep_quantized
from otfload.stages import Loaded, Stage

if TYPE_CHECKING:
    from otfload.plan.planner import LoadPlan


class KeptQuantized(Stage):
    """Each quantized leaf planned as its stored parts (a plan transform) and the placed parts
    assembled into a ``QuantizedArray`` (a finisher). ``layers_only``: a bundled model, which keeps
    only the leaves of its layer stack (``LeafPlan.in_layer_stack``; others are dequantised on load)."""

    name = "kept-quantized"

    def __init__(self, *, layers_only: bool):
        self.layers_only = layers_only

    def plan(self, plan: LoadPlan) -> LoadPlan:
        return keep_quantized(plan, layers_only=self.layers_only)

    def finish(self, loaded: Loaded) -> None:
        loaded.arrays = assemble_kept(loaded.plan, loaded.arrays)


class ActivationScales(Stage):
    """The plan's activation scales read into ``LoadReport.activation_scales``, counted in the
    report's fetched bytes and requests as the leaves' reads are."""

    name = "activation-scales"

    def finish(self, loaded: Loaded) -> None:
        infos = list(loaded.plan.activation.values())
        meter = FetchMeter()
        with metering(meter):
            values = read_values(loaded.source, infos)
        loaded.report.bytes_read += meter.bytes
        loaded.report.requests += meter.requests
        loaded.report.activation_scales = dict(zip(loaded.plan.activation, values, strict=True))


__all__ = ["ActivationScales", "KeptQuantized"]
