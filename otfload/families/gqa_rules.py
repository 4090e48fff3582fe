"""Mapping rules of a GQA attention block (:class:`otfload.models.gqa.Attention`) that families
share: q/k/v/o kernels from HF's ``[out, in]`` projections with their heads split by ``Reshape``,
q/k/v/o biases, and the q/k norms of either kind (per head: ``(head_dim,)`` as stored; over the
whole projection: HF's ``[heads * head_dim]`` reshaped to the leaf's ``(heads, head_dim)``).
A rule whose tensor a checkpoint lacks (biases, norms) matches no leaf the model builds without it."""

from __future__ import annotations

from collections.abc import Callable

from otfload.models.gqa import PER_HEAD, WHOLE
from otfload.plan.hooks import Reshape
from otfload.plan.mapping import Rule

HEADS = ("num_attention_heads", "head_dim")
KV_HEADS = ("num_key_value_heads", "head_dim")


def gqa_rules(target: str, source: str, qk_norm_over: str = PER_HEAD,
              rule: Callable[..., Rule] = Rule) -> list[Rule]:
    """Rules for the attention leaves under ``target`` (``layers.{layer}.attn``) from the HF module
    ``source`` (``model.layers.{layer}.self_attn``); ``rule`` makes each (e.g. with ``offsets``)."""
    rules = [rule(f"{target}.o.kernel", f"{source}.o_proj.weight", (Reshape(("hidden_size", *HEADS)),)),
             rule(f"{target}.o.bias", f"{source}.o_proj.bias")]
    for name, heads in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
        rules += [rule(f"{target}.{name}.kernel", f"{source}.{name}_proj.weight", (Reshape((*heads, "hidden_size")),)),
                  rule(f"{target}.{name}.bias", f"{source}.{name}_proj.bias", (Reshape(heads),))]
    for name, heads in (("q", HEADS), ("k", KV_HEADS)):
        hooks = (Reshape(heads),) if qk_norm_over == WHOLE else ()
        rules.append(rule(f"{target}.{name}_norm.scale", f"{source}.{name}_norm.weight", hooks))
    return rules
