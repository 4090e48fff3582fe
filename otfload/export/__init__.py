"""Export to Hugging Face safetensors: the loader's mapping tables run backwards.

    otfload.export.export_hf(model, "./out", reference="./my-llama")
    otfload.export.export_native("/ckpt/run1", "./out")  # a native (Orbax) checkpoint

``inverse`` plans which HF tensor every leaf slice becomes, ``shapes`` infers HF shapes when no
reference checkpoint is given, ``job`` fixes the tensors, dtypes and config to write, ``gather``
copies one leaf slice to the host shard by shard, ``distributed`` has every process of a
``jax.distributed`` job write its share of the files, ``native`` exports a native checkpoint leaf
by leaf, and ``writer`` writes shards, index and config atomically.
"""

from otfload.export.api import export_checkpoint, export_hf
from otfload.export.inverse import ExportPlan, HFTensor, plan_export
from otfload.export.native import export_native, is_native_checkpoint

__all__ = [
    "ExportPlan",
    "HFTensor",
    "export_checkpoint",
    "export_hf",
    "export_native",
    "is_native_checkpoint",
    "plan_export",
]
