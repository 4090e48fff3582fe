"""otfload: load Hugging Face safetensors checkpoints on the fly into sharded JAX/Flax trees.

    model = otfload.from_pretrained("./my-llama", mesh=mesh)

The pipeline, one package each: ``sources`` (where bytes come from) → ``index`` (what the files
hold) → ``plan`` (target leaf ← HF keys, hooks, stacking, sharding, byte runs) → ``read`` (byte
ranges into scratch) → ``place`` (hooks, one ``np.stack``, placement) → this API.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what a type checker reads; at run time each name is imported on first use
    from otfload.adapters.export import export_adapter
    from otfload.adapters.factored import load_adapter
    from otfload.api import from_pretrained, load_params, plan_model, plan_params
    from otfload.errors import (
        AdapterError,
        CheckpointIndexError,
        CheckpointMismatchError,
        CorruptFileError,
        HeaderError,
        IndivisibleShardingError,
        MappingError,
        MeshRequiredError,
        MissingTensorError,
        OtfloadError,
        OutputExistsError,
        ShapeMismatchError,
        SourceError,
        SourceNotFoundError,
        TruncatedFileError,
        UnexpectedTensorError,
        UnknownDtypeError,
        UnmappedLeafError,
        UnsafeFormatError,
        UnsupportedModelError,
    )
    from otfload.evaluate import EvalResult, evaluate
    from otfload.export import export_checkpoint, export_hf, export_native
    from otfload.generate import generate
    from otfload.options import LoadOptions
    from otfload.place.report import LoadReport
    from otfload.plan.eval_shape import abstract_module
    from otfload.plan.hooks import Hook, Reshape, Scale, Slice, Transpose
    from otfload.plan.mapping import MappingTable, Rule
    from otfload.plan.sharding import DEFAULT_RULES, logical_to_sharding, make_mesh
    from otfload.quantized import QuantizedArray, dequantize

# Each public name and the module defining it: ``import otfload`` (and the command line's
# ``--help``/``--version``) imports neither JAX nor the pipeline until a name is used.
_HOMES: dict[str, str] = {
    "export_adapter": "otfload.adapters.export",
    "load_adapter": "otfload.adapters.factored",
    "from_pretrained": "otfload.api",
    "load_params": "otfload.api",
    "plan_model": "otfload.api",
    "plan_params": "otfload.api",
    "AdapterError": "otfload.errors",
    "CheckpointIndexError": "otfload.errors",
    "CheckpointMismatchError": "otfload.errors",
    "CorruptFileError": "otfload.errors",
    "HeaderError": "otfload.errors",
    "IndivisibleShardingError": "otfload.errors",
    "MappingError": "otfload.errors",
    "MeshRequiredError": "otfload.errors",
    "MissingTensorError": "otfload.errors",
    "OtfloadError": "otfload.errors",
    "OutputExistsError": "otfload.errors",
    "ShapeMismatchError": "otfload.errors",
    "SourceError": "otfload.errors",
    "SourceNotFoundError": "otfload.errors",
    "TruncatedFileError": "otfload.errors",
    "UnexpectedTensorError": "otfload.errors",
    "UnknownDtypeError": "otfload.errors",
    "UnmappedLeafError": "otfload.errors",
    "UnsafeFormatError": "otfload.errors",
    "UnsupportedModelError": "otfload.errors",
    "EvalResult": "otfload.evaluate",
    "evaluate": "otfload.evaluate",
    "export_checkpoint": "otfload.export",
    "export_hf": "otfload.export",
    "export_native": "otfload.export",
    "generate": "otfload.generate",
    "LoadOptions": "otfload.options",
    "LoadReport": "otfload.place.report",
    "abstract_module": "otfload.plan.eval_shape",
    "Hook": "otfload.plan.hooks",
    "Reshape": "otfload.plan.hooks",
    "Scale": "otfload.plan.hooks",
    "Slice": "otfload.plan.hooks",
    "Transpose": "otfload.plan.hooks",
    "MappingTable": "otfload.plan.mapping",
    "Rule": "otfload.plan.mapping",
    "DEFAULT_RULES": "otfload.plan.sharding",
    "logical_to_sharding": "otfload.plan.sharding",
    "make_mesh": "otfload.plan.sharding",
    "QuantizedArray": "otfload.quantized",
    "dequantize": "otfload.quantized",
}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module on first use (PEP 562); a subpackage (``otfload.sources``)
    the same way."""
    if name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])


class _Package(types.ModuleType):
    """This package's module type: a public function named as its module (``evaluate``, ``generate``)
    keeps its name when the module is imported (the import system sets the attribute to the module)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__version__ = "0.1.0"

__all__ = [
    "DEFAULT_RULES",
    "AdapterError",
    "CheckpointIndexError",
    "CheckpointMismatchError",
    "CorruptFileError",
    "EvalResult",
    "HeaderError",
    "Hook",
    "IndivisibleShardingError",
    "LoadOptions",
    "LoadReport",
    "MappingError",
    "MappingTable",
    "MeshRequiredError",
    "MissingTensorError",
    "OtfloadError",
    "OutputExistsError",
    "QuantizedArray",
    "Reshape",
    "Rule",
    "Scale",
    "ShapeMismatchError",
    "Slice",
    "SourceError",
    "SourceNotFoundError",
    "Transpose",
    "TruncatedFileError",
    "UnexpectedTensorError",
    "UnknownDtypeError",
    "UnmappedLeafError",
    "UnsafeFormatError",
    "UnsupportedModelError",
    "abstract_module",
    "dequantize",
    "evaluate",
    "export_adapter",
    "export_checkpoint",
    "export_hf",
    "export_native",
    "from_pretrained",
    "generate",
    "load_adapter",
    "load_params",
    "logical_to_sharding",
    "make_mesh",
    "plan_model",
    "plan_params",
]
