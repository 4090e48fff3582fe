"""DeepSeek-V2/V3 config: ``config.json`` parsed and checked into a :class:`DeepseekConfig` (MLA
ranks and head dims, dense/MoE layer split, routing, RoPE): the MLA families' shared config
(:class:`otfload.families.mla.MlaConfig`), without an indexer."""

from otfload.families.mla import EXPERT_FIELDS
from otfload.families.mla import MlaConfig as DeepseekConfig

__all__ = ["EXPERT_FIELDS", "DeepseekConfig"]
