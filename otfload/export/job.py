"""What an export writes, decided before any tensor is read: the inverse plan, each HF tensor's
shape and dtype in file order, and the ``config.json``; shared by every way of exporting."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from otfload.export.inverse import ExportPlan, Fetch, plan_export
from otfload.export.writer import TensorSpec, natural_key
from otfload.families.registry import Family, family_for
from otfload.index.dtypes import safetensors_name, to_numpy_dtype
from otfload.plan.mapping import MappingTable, Rule, as_table

# config.json field naming the weights' dtype (transformers 5; older versions write torch_dtype).
_DTYPE_FIELDS = ("dtype", "torch_dtype")
_DTYPE_NAMES = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "F64": "float64"}


def _table(
    hf_config: dict[str, Any],
    family: str | Family[Any] | None,
    mapping: MappingTable | Sequence[Rule] | Mapping[str, str] | None,
    hf_shapes: Mapping[str, tuple[int, ...]] | None,
) -> tuple[MappingTable, dict[str, Any]]:
    """The mapping table and the config its hooks are resolved against (with the layout of the
    reference's tensors when one is given: :attr:`Family.layout`)."""
    if mapping is not None:
        return as_table(mapping), hf_config
    if isinstance(family, str):
        family = family_for({"model_type": family})
    family = family or family_for(hf_config)
    cfg = family.parse_config(hf_config)
    if hf_shapes is not None:
        cfg = family.layout(cfg, hf_shapes.keys())
    return family.mapping(cfg), cfg.to_dict()


@dataclass(frozen=True)
class ExportJob:
    """The inverse ``plan``, the tensors to write (``specs``, in file order) and the ``config`` to write."""

    plan: ExportPlan
    specs: tuple[TensorSpec, ...]
    config: dict[str, Any]

    @classmethod
    def build(
        cls,
        leaves: Mapping[str, Any],
        hf_config: dict[str, Any],
        *,
        family: str | Family[Any] | None = None,
        mapping: MappingTable | Sequence[Rule] | Mapping[str, str] | None = None,
        hf_shapes: Mapping[str, tuple[int, ...]] | None = None,
        dtype: Any = None,
    ) -> ExportJob:
        """Plan the export of ``leaves`` (dotted path → anything with ``shape`` and ``dtype``).

        ``dtype`` ``None`` keeps each leaf's dtype, otherwise every tensor (and ``config.json``'s
        dtype field) is cast; a dtype safetensors cannot store fails here, before anything is written.
        """
        # The weights written are dequantised: a source's quantization_config no longer applies.
        hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        text = hf_config.get("text_config")
        if isinstance(text, Mapping) and "quantization_config" in text:  # a multimodal wrapper's text model
            hf_config["text_config"] = {k: v for k, v in text.items() if k != "quantization_config"}
        table, hook_config = _table(hf_config, family, mapping, hf_shapes)
        shapes = {path: tuple(leaf.shape) for path, leaf in leaves.items()}
        plan = plan_export(shapes, table, hook_config, hf_shapes, tied=bool(hf_config.get("tie_word_embeddings")))
        if dtype is not None:
            target = to_numpy_dtype(dtype)
            name = _DTYPE_NAMES.get(safetensors_name(target))
            hf_config = {**hf_config, **{f: name for f in _DTYPE_FIELDS if f in hf_config or f == "dtype"}}
        specs = tuple(
            TensorSpec(k, t.shape, target if dtype is not None else np.dtype(leaves[t.parts[0].leaf].dtype))
            for k, t in sorted(plan.tensors.items(), key=lambda kv: natural_key(kv[0]))
        )
        return cls(plan, specs, hf_config)

    def producer(self, fetch: Fetch) -> Callable[[str], np.ndarray]:
        """``key → tensor`` in its output dtype, built from ``fetch(leaf, index)`` host slices."""
        dtypes = {s.key: s.dtype for s in self.specs}

        def produce(key: str) -> np.ndarray:
            return self.plan.tensors[key].materialize(fetch).astype(dtypes[key], copy=False)

        return produce
