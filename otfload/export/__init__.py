"""Export to Hugging Face safetensors: the loader's mapping tables run backwards.

    otfload.export.export_hf(model, "./out", reference="./my-llama")

``inverse`` plans which HF tensor every leaf slice becomes, ``shapes`` infers HF shapes when no
reference checkpoint is given, ``gather`` copies one leaf slice to the host shard by shard, and
``writer`` writes shards, index and config atomically.
"""

from otfload.export.api import export_checkpoint, export_hf
from otfload.export.inverse import ExportPlan, HFTensor, plan_export

__all__ = ["ExportPlan", "HFTensor", "export_checkpoint", "export_hf", "plan_export"]
