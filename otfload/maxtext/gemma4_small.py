"""MaxText's Gemma 4 E2B and E4B (``gemma4-e2b``, ``gemma4-e4b``; ``decoder_block: gemma4_small``), as its
converter (``param_mapping.GEMMA4_SMALL_*``) writes them. MaxText builds them unscanned only
(``decoder.layers_<i>``: the per-layer inputs and the shared keys and values are threaded through the
layer loop), so the tables have no scanned groups: a scanned config is refused on ``scan_layers``.

* Layer ``i`` is global where ``i % period == period - 1`` (``gemma4_small.get_attention_type``: E2B
  four sliding then one global, period 5; E4B five then one, period 6), its query, output and query
  norm with ``global_head_dim``, its keys and values with ``num_kv_heads`` heads (MaxText reads
  ``global_num_kv_heads`` only where it is set, which neither release's config does);
* the last ``num_kv_shared_layers`` layers read the keys and values of an earlier layer: they have no
  ``key`` / ``value`` / ``key_norm`` leaves (nor does the checkpoint have those tensors), and with
  ``use_double_wide_mlp`` (E2B) an MLP twice ``mlp_dim`` wide;
* every layer's per-layer-input leaves (``per_layer_input_gate``, ``per_layer_projection`` kernels
  ``[in, out]``, ``post_per_layer_input_norm``) and the per-layer embedder,
  ``decoder.per_layer_embedder``: ``embed_tokens_per_layer`` as stored ``[vocab_per_layer, layers *
  per_layer_dim]`` (unscaled: MaxText scales it as it runs), ``per_layer_model_projection.kernel``
  ``[embed, layers * per_layer_dim]``, ``per_layer_projection_norm``;
* norms, ``layer_scalar`` as stored, the embedding times ``float32(sqrt(hidden))`` (as the 26B / 31B).

The kinds of layers share leaf paths with other shapes; each kind's rules match only its layers
(:attr:`otfload.plan.mapping.Rule.only`, from the groups' ``at``, the shared tail's start a config
expression).
"""

from __future__ import annotations

from otfload.families.multimodal import LANGUAGE_MODEL_PREFIXES, MODULE_PREFIXES
from otfload.maxtext.gemma import MultimodalTable, top
from otfload.maxtext.gemma4 import NORMS, SCALAR, key_value, query
from otfload.maxtext.tables import HF_LAYER, UNSCANNED, LayerGroup, Leaf, ModelTable, dense_mlp, kernel, norm
from otfload.plan.mapping import Stride

PLE = "mt_hidden_size_per_layer_input"
FIRST_SHARED = "mt_num_decoder_layers - mt_num_kv_shared_layers"
_PER_LAYER = (
    kernel("per_layer_input_gate.kernel", f"{HF_LAYER}.per_layer_input_gate.weight", ("mt_emb_dim", PLE),
           ("fsdp", "tensor")),
    kernel("per_layer_projection.kernel", f"{HF_LAYER}.per_layer_projection.weight", (PLE, "mt_emb_dim"),
           ("tensor", "fsdp")),
    norm("post_per_layer_input_norm.scale", f"{HF_LAYER}.post_per_layer_input_norm.weight"),
)
_EMBEDDER = "decoder.per_layer_embedder"
_PER_LAYER_WIDTH = f"mt_num_decoder_layers * {PLE}"
_TOP = (
    Leaf(f"{_EMBEDDER}.embed_tokens_per_layer", "model.embed_tokens_per_layer.weight", (),
         ("mt_vocab_size_per_layer_input", _PER_LAYER_WIDTH), ("tensor", "fsdp")),
    kernel(f"{_EMBEDDER}.per_layer_model_projection.kernel", "model.per_layer_model_projection.weight",
           ("mt_emb_dim", _PER_LAYER_WIDTH), ("fsdp", "tensor")),
    norm(f"{_EMBEDDER}.per_layer_projection_norm.scale", "model.per_layer_projection_norm.weight", PLE),
)


def _group(leaves: tuple[Leaf, ...], count: str, *at: Stride) -> LayerGroup:
    return LayerGroup(UNSCANNED, UNSCANNED, leaves, count, at=at)


def _table(name: str, period: int) -> ModelTable:
    """The table of a Gemma 4 small whose attention repeats ``period - 1`` sliding layers then a global one."""
    sliding, full = tuple(Stride(period, j) for j in range(period - 1)), Stride(period, period - 1)
    globals_, owners_global = f"mt_num_decoder_layers // {period}", f"({FIRST_SHARED}) // {period}"
    return MultimodalTable(
        name=name,
        model_types=frozenset({"gemma4"}),
        top=(*top("sqrt(mt_emb_dim)")[:1], norm("decoder.decoder_norm.scale", "model.norm.weight"), *_TOP),
        groups=(),
        unscanned=(
            _group((*NORMS, SCALAR, *_PER_LAYER), "mt_num_decoder_layers"),
            _group(query("mt_head_dim"), f"mt_num_decoder_layers - {globals_}", *sliding),
            _group(query("mt_global_head_dim"), globals_, full),
            _group(key_value("mt_num_kv_heads", "mt_head_dim", value=True), f"{FIRST_SHARED} - {owners_global}",
                   *sliding),
            _group(key_value("mt_num_kv_heads", "mt_global_head_dim", value=True), owners_global, full),
            _group(dense_mlp(), FIRST_SHARED, Stride(1)),
            _group(dense_mlp(width="mt_mlp_dim * (1 + mt_use_double_wide_mlp)"), "mt_num_kv_shared_layers",
                   Stride(1, FIRST_SHARED)),
        ),
        fields=("global_head_dim", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                "num_kv_shared_layers"),
        flags=("use_double_wide_mlp",),
        layouts=(MODULE_PREFIXES, LANGUAGE_MODEL_PREFIXES),
    )


GEMMA4_E2B = _table("gemma4_e2b", 5)
GEMMA4_E4B = _table("gemma4_e4b", 6)
