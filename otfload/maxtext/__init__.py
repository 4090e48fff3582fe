"""MaxText on otfload: a drop-in for MaxText's on-the-fly HF loader, on MaxText's real parameter
trees, in every layer layout (docs/maxtext.md).

    _, restored = otfload.maxtext.load_state(path, abstract_params, maxtext_config)

``load_state`` takes and returns what MaxText's ``load_safetensors_dynamic_state`` does;
``export`` writes MaxText parameters back as HF safetensors. The tables, one module per MaxText
decoder block (``llama``, ``qwen2``, ``qwen3``, ``mixtral``, built from ``tables``' leaves), are chosen from
the MaxText config by ``selection`` (``model_name``, ``scan_layers``, ``param_scan_axis``,
``vocab_size``), never from shapes; ``abstract`` builds MaxText's tree without MaxText.
"""

from otfload.maxtext.abstract import abstract_params
from otfload.maxtext.load import load_state
from otfload.maxtext.save import export
from otfload.maxtext.selection import TABLES, Selection, select

__all__ = ["TABLES", "Selection", "abstract_params", "export", "load_state", "select"]
