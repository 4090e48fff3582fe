"""otfload: load Hugging Face safetensors checkpoints on the fly into sharded JAX/Flax trees.

    model = otfload.from_pretrained("./my-llama", mesh=mesh)

The pipeline, one package each: ``sources`` (where bytes come from) → ``index`` (what the files
hold) → ``plan`` (target leaf ← HF keys, hooks, stacking, sharding, byte runs) → ``read`` (byte
ranges into scratch) → ``place`` (hooks, one ``np.stack``, placement) → this API.
"""

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
