"""Optional features of a load as stages, each run only when the load asks for it.

A plain load (no adapter, ``quantized="dequantize"``, ``merge_adapter=True``) runs no stage and
imports none of the features' code (``tests/test_stages.py`` reads ``sys.modules`` in a fresh
process). A stage acts at one or more of three points, each a method of :class:`Stage`:

* **an index overlay**, at the front door: :mod:`otfload.opening` layers PEFT adapters on the opened
  base (:class:`~otfload.stages.adapters.AdapterOverlay`, made only when the options name an adapter
  or the location holds one); :attr:`otfload.opening.Opened.stages` carries it on;
* **a plan transform** (:meth:`Stage.plan`), when the plan is built: the adapter overlay checks that
  every adapted tensor feeds a leaf; ``quantized="keep"`` plans each quantized leaf as its stored
  parts (:class:`~otfload.stages.quantized.KeptQuantized`);
* **a load step**: :meth:`Stage.read` before the leaves are read (``merge_adapter=False`` takes the
  LoRA terms out of the plan and places the factors, :class:`~otfload.stages.adapters.KeptFactors`),
  :meth:`Stage.finish` after they are placed (the kept parts assembled into ``QuantizedArray`` s, the
  factors wrapped into ``LoraWeight`` s, a checkpoint's activation scales read,
  :class:`~otfload.stages.quantized.ActivationScales`).

Each stage checks what it is given (its own errors), so the entry points (:mod:`otfload.api`) only
choose the stages (:func:`option_stages`) and run them in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from otfload.options import LoadOptions
    from otfload.place.report import LoadReport
    from otfload.plan.planner import LoadPlan
    from otfload.sources import Source


@dataclass
class Loaded:
    """What a finisher works on: the plan that was run, the open source, the placed leaf values by
    path (a finisher replaces them), the report, and the bundled model they go into (None for a
    tree the caller brings)."""

    plan: LoadPlan
    source: Source
    arrays: dict[str, Any]
    report: LoadReport
    model: Any = None


class Stage:
    """An optional feature of a load; each method is a no-op unless the stage overrides it."""

    name = "stage"

    def plan(self, plan: LoadPlan) -> LoadPlan:
        """The plan with this feature applied (at planning time: reads nothing)."""
        return plan

    def read(self, plan: LoadPlan, source: Source, given: object) -> LoadPlan:
        """The plan the load runs, after what this feature reads first (at load time); on failure
        ``source`` is closed unless it is ``given``, the caller's own."""
        return plan

    def finish(self, loaded: Loaded) -> None:
        """Complete ``loaded`` once every leaf is placed (the source still open)."""


def option_stages(options: LoadOptions, *, bundled: bool) -> tuple[Stage, ...]:
    """The stages ``options`` ask for beyond the front door's overlay, in the order they run;
    ``bundled``: the target is a bundled model (``from_pretrained``), not a tree the caller brings."""
    stages: list[Stage] = []
    if options.quantized == "keep":
        from otfload.stages.quantized import KeptQuantized

        stages.append(KeptQuantized(layers_only=bundled))
    if not options.merge_adapter:
        from otfload.stages.adapters import KeptFactors

        stages.append(KeptFactors(bundled=bundled))
    return tuple(stages)


def plan_stages(stages: tuple[Stage, ...], plan: LoadPlan) -> LoadPlan:
    """``plan`` through every stage's plan transform, in order."""
    for stage in stages:
        plan = stage.plan(plan)
    return plan


def plan_finishers(plan: LoadPlan) -> tuple[Stage, ...]:
    """The stages a built plan itself asks for: the checkpoint's activation scales, when it has any."""
    if not plan.activation:
        return ()
    from otfload.stages.quantized import ActivationScales

    return (ActivationScales(),)


__all__ = ["Loaded", "Stage", "option_stages", "plan_finishers", "plan_stages"]
