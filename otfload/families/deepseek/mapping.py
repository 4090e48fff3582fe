"""The mapping table of DeepSeek-V2 and DeepSeek-V3 (``deepseek_v2``, ``deepseek_v3``) and their
checks: the MLA families' table (:data:`otfload.families.mla.MLA_TABLE`, whose docstring says how
it maps), whose indexer rules match nothing here.

Kimi-K2 (``kimi_k2``) is the DeepSeek-V3 architecture under another name (its ``architectures`` say
``DeepseekV3ForCausalLM``): the same model and table. Kimi-K2.5 (``kimi_k25``) wraps a ``kimi_k2``
language model (``text_config``, tensors under ``language_model.``) with a vision tower, which is
never read (:mod:`otfload.families.multimodal`; both are registered in :mod:`otfload.families.deepseek`);
its ``text_config`` carries the ``quantization_config`` (int4 routed experts), which the index
honours there.
"""

from otfload.families.mla import MLA_TABLE as DEEPSEEK_TABLE
from otfload.families.mla import mla_checks as deepseek_checks

__all__ = ["DEEPSEEK_TABLE", "deepseek_checks"]
