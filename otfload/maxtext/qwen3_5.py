"""MaxText's Qwen3.5 (``decoder_block: qwen3_5``, ``qwen3.5-35b-a3b``, ``qwen3.5-397b-a17b``), as its
converter (``param_mapping.QWEN3_5_*``) writes it from the published checkpoints' text model
(``model.language_model.*``; the vision tower is not read): Qwen3-Next's leaves
(:mod:`otfload.maxtext.qwen3_next`), but for two: the Gated DeltaNet's ``in_proj_qkvz`` joins
``in_proj_qkv`` and ``in_proj_z`` and ``in_proj_ba`` joins ``in_proj_b`` and ``in_proj_a``, key head
by key head (that head's q, k, v rows, then its z rows; its b rows, then its a rows), transposed:
a :class:`~otfload.plan.mapping.Join`, each HF tensor read only where a device's box needs it.

The routed experts are read as each release stores them, as MaxText's converter reads them: the
published bfloat16 checkpoints fuse each layer's experts (``mlp.experts.gate_up_proj`` ``[E, 2 *
moe_mlp, embed]``, its first half ``wi_0``, its second ``wi_1``, each ``[E, embed, moe_mlp]``;
``mlp.experts.down_proj`` ``[E, embed, moe_mlp]`` as ``wo``), the FP8 releases (``qwen3.5-*-fp8``,
:data:`QWEN3_5_FP8`) store one tensor per expert (as Qwen3-Next's), block-scaled: every quantized
tensor, the joins' parts too, is decoded as it is read.

Scanned, ``decoder.layers.layer_<j>`` (``j`` < ``inhomogeneous_layer_cycle_interval`` 4) stacks HF layers
``j, j + 4, ...`` at ``param_scan_axis``: ``layer_3`` the full attention's, the others the linear ones.
Unscanned, ``decoder.layers_<i>`` holds its kind's leaves, as Qwen3-Next's.
"""

from __future__ import annotations

import dataclasses

from otfload.maxtext.qwen3_next import PERIOD, QWEN3_NEXT
from otfload.maxtext.tables import CYCLE, HF_LAYER, SCANNED, UNSCANNED, LayerGroup, Leaf, ModelTable
from otfload.plan.hooks import Slice, Transpose
from otfload.plan.mapping import Join, Stride

HF, MM = "model.", "model.language_model."
_KEY_DIM = "mt_gdn_num_key_heads * mt_gdn_key_head_dim"
_VALUE_DIM = "mt_gdn_num_value_heads * mt_gdn_value_head_dim"
_JOINED = ("attention.in_proj_qkvz.kernel", "attention.in_proj_ba.kernel")
_EXPERTS = "mlp.routed_experts"
_FUSED = f"{MM}{HF_LAYER.removeprefix(HF)}.mlp.experts"
_SWAP = Transpose((0, 2, 1))
_EXPERT_IN = ("mt_num_experts", "mt_emb_dim", "mt_moe_mlp_dim")
# the published bfloat16 checkpoints' fused experts (param_mapping.QWEN3_5_*: gate_up_proj, down_proj)
_FUSED_EXPERTS = (
    Leaf(f"{_EXPERTS}.wi_0", f"{_FUSED}.gate_up_proj", (Slice(1, 0, "mt_moe_mlp_dim"), _SWAP), _EXPERT_IN,
         (None, "fsdp", "tensor")),
    Leaf(f"{_EXPERTS}.wi_1", f"{_FUSED}.gate_up_proj", (Slice(1, "mt_moe_mlp_dim"), _SWAP), _EXPERT_IN,
         (None, "fsdp", "tensor")),
    Leaf(f"{_EXPERTS}.wo", f"{_FUSED}.down_proj", (_SWAP,), ("mt_num_experts", "mt_moe_mlp_dim", "mt_emb_dim"),
         (None, "tensor", "fsdp")),
)


def _language_model(leaf: Leaf) -> Leaf:
    """``leaf`` reading the multimodal checkpoint's text model (``model.language_model.``)."""
    return dataclasses.replace(leaf, source=MM + leaf.source.removeprefix(HF)) if leaf.source.startswith(HF) else leaf


def _join(leaf: Leaf, parts: tuple[tuple[str, tuple[str, ...]], ...]) -> Leaf:
    """Qwen3-Next's fused ``leaf`` from Qwen3.5's ``parts`` (names beside it), joined per key head."""
    module = leaf.source.rsplit(".", 2)[0]
    return dataclasses.replace(leaf, join=Join(tuple((f"{module}.{name}.weight", blocks) for name, blocks in parts),
                                               "mt_gdn_num_key_heads"))


_shared, _linear, _full = ([_language_model(leaf) for leaf in g.leaves] for g in QWEN3_NEXT.unscanned or ())
_PER_EXPERT = tuple(_shared)
_FUSED_SHARED = (*(leaf for leaf in _shared if leaf.path not in {e.path for e in _FUSED_EXPERTS}), *_FUSED_EXPERTS)
_qkvz, _ba = (next(leaf for leaf in _linear if leaf.path == path) for path in _JOINED)
_LINEAR = (
    _join(_qkvz, (("in_proj_qkv", (_KEY_DIM, _KEY_DIM, _VALUE_DIM)), ("in_proj_z", (_VALUE_DIM,)))),
    _join(_ba, (("in_proj_b", ("mt_gdn_num_value_heads",)), ("in_proj_a", ("mt_gdn_num_value_heads",)))),
    *(leaf for leaf in _linear if leaf.path not in _JOINED),
)
_FULL = tuple(_full)
_BLOCKS = f"mt_num_decoder_layers // {PERIOD}"


def _table(name: str, shared: tuple[Leaf, ...]) -> ModelTable:
    """Qwen3.5's table whose every layer has the norms and MoE leaves ``shared``."""
    return ModelTable(
        name=name,
        model_types=frozenset({"qwen3_5_moe"}),
        top=tuple(_language_model(leaf) for leaf in QWEN3_NEXT.top),
        groups=tuple(LayerGroup(f"{SCANNED}.layer_{j}", f"{SCANNED}.layer_{j}",
                                (*shared, *(_FULL if j == PERIOD - 1 else _LINEAR)), _BLOCKS,
                                indices={"layer": Stride(PERIOD, j)}) for j in range(PERIOD)),
        unscanned=(LayerGroup(SCANNED, UNSCANNED, shared),
                   LayerGroup(SCANNED, UNSCANNED, _LINEAR, f"{_BLOCKS} * {PERIOD - 1}",
                              at=tuple(Stride(PERIOD, j) for j in range(PERIOD - 1))),
                   LayerGroup(SCANNED, UNSCANNED, _FULL, _BLOCKS, at=(Stride(PERIOD, PERIOD - 1),))),
        fields=QWEN3_NEXT.fields,
        fixed={CYCLE.removeprefix("mt_"): PERIOD},
    )


QWEN3_5 = _table("qwen3_5", _FUSED_SHARED)
QWEN3_5_FP8 = _table("qwen3_5_fp8", _PER_EXPERT)
