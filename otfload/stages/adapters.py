"""The PEFT LoRA stages: the adapter overlay (merged, the default) and kept factors
(``merge_adapter=False``). :mod:`otfload.adapters` is imported only when a stage here is made.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from otfload.stages import Loaded, Stage

if TYPE_CHECKING:
    from otfload.adapters.factored import FactoredLoad
    from otfload.index.checkpoint import CheckpointIndex
    from otfload.plan.planner import LoadPlan
    from otfload.sources import Source

# What marks a location as an adapter and no model (otfload.adapters.config.CONFIG_FILE and
# otfload.index.checkpoint.CONFIG_FILE; tests/adapters/test_stages.py keeps them equal).
ADAPTER_CONFIG_FILE = "adapter_config.json"
MODEL_CONFIG_FILE = "config.json"


def holds_adapter(source: Source) -> bool:
    """Whether ``source`` holds an adapter and no model (``adapter_config.json``, no ``config.json``)."""
    files = set(source.list_files())
    return ADAPTER_CONFIG_FILE in files and MODEL_CONFIG_FILE not in files


class AdapterOverlay(Stage):
    """Adapters layered on the opened base (an index overlay, applied by :mod:`otfload.opening`).
    Its plan transform refuses, in a bundled family's plan, an adapted tensor that feeds no leaf (the
    family does not map that module); a tree the caller brings may map only some modules."""

    name = "adapter"

    def __init__(self, index: CheckpointIndex):
        self.index = index  # the base's index with the adapters' terms merged in

    def plan(self, plan: LoadPlan) -> LoadPlan:
        from otfload.adapters.merge import check_adapted_are_mapped

        if plan.family:
            check_adapted_are_mapped(plan, self.index)
        return plan


class KeptFactors(Stage):
    """``merge_adapter=False``: the LoRA terms taken back out of the plan and the factors placed as
    their own parameters before the base is read; the leaves wrapped into ``LoraWeight`` s after.
    Only for a bundled model, whose forward pass applies them (``AdapterError`` otherwise)."""

    name = "kept-factors"

    def __init__(self, *, bundled: bool):
        from otfload.adapters.factored import require_merged

        require_merged(bundled)
        self._load: FactoredLoad | None = None

    def read(self, plan: LoadPlan, source: Source, given: object) -> LoadPlan:
        from otfload.adapters.factored import prepare_factored

        self._load = prepare_factored(plan, source, given)  # reads and places the factors
        return self._load.plan

    def finish(self, loaded: Loaded) -> None:
        assert self._load is not None, "read() runs before finish()"
        loaded.arrays = self._load.finish(loaded.model, loaded.arrays, loaded.report)


__all__ = ["AdapterOverlay", "KeptFactors", "holds_adapter"]
