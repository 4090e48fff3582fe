"""The building blocks of the MaxText tables: one :class:`Leaf` per kind of MaxText parameter, and
:class:`ModelTable`, a model's leaves turned into an otfload mapping table for one layout.

MaxText's NNX parameter trees (``nnx.state(model, nnx.Param)``) have no ``params.`` prefix::

    token_embedder.embedding                       [vocab, embed]
    decoder.decoder_norm.scale                     [embed]
    decoder.logits_dense.kernel                    [embed, vocab]   (absent with logits_via_embedding)
    decoder.layers.<block leaf>                    scan_layers: one leaf for all layers
    decoder.layers_<i>.<block leaf>                unscanned: one subtree per layer

A model whose layers are not all alike has a :class:`LayerGroup` per kind (DeepSeek's
``decoder.dense_layers`` / ``decoder.moe_layers``; GPT-OSS's scanned ``decoder.layers.layers_<j>``,
every ``inhomogeneous_layer_cycle_interval``-th layer), each with its own layer count and the HF
layers it reads (:class:`~otfload.plan.mapping.Rule` ``offsets`` / ``indices``).

A scanned leaf has the layer axis at dimension ``param_scan_axis`` (MaxText's default 1: a norm
scale is ``[embed, layers]``, a query kernel ``[embed, layers, heads, head_dim]``); a stack of
experts leads (``[experts, layers, embed, mlp]`` at ``param_scan_axis`` 1, ``[layers, experts, ...]``
at 0): every block rule says ``stack_at={"layer": "param_scan_axis"}`` and the expert axis takes
the lowest dimension left (:func:`otfload.plan.mapping.stack_dims`).

Hooks and shapes name MaxText's config fields with an ``mt_`` prefix (``mt_head_dim``,
``mt_vocab_size``; :func:`otfload.maxtext.selection.hook_config` fills them), so that they never
collide with the HF ``config.json`` fields an export writes beside them. Kernels are ``[in, out]``,
the transpose of HF's ``[out, in]``, with the heads split.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from otfload.plan.expressions import integer
from otfload.plan.hooks import Hook, Pad, Reshape, Scale, Transpose
from otfload.plan.mapping import Composed, Join, MappingTable, Rule, Stride

SCANNED = "decoder.layers"
UNSCANNED = "decoder.layers_{layer}"
HF_LAYER = "model.layers.{layer}"
LOGITS = "decoder.logits_dense.kernel"
# The size of an expert stack axis (a layer axis has its group's count).
EXPERTS = "mt_num_experts"
# the two stack axes of a group stacked twice (LayerGroup.local)
BLOCK, LOCAL = "block", "local"
T = Transpose()


@dataclass(frozen=True)
class Leaf:
    """One kind of MaxText leaf: its path (under the layer prefix for a block leaf), the HF key
    template, the hooks, and one slice's shape (MaxText fields) and mesh axes (MaxText's default
    logical rules: ``fsdp`` on the embedding dimension, ``tensor`` on heads, MLP and vocabulary)."""

    path: str
    source: str
    hooks: tuple[Hook, ...]
    shape: tuple[str, ...]
    axes: tuple[str | None, ...]
    # where a scanned tree puts the layer axis: MaxText scans nnx.Params at param_scan_axis, its
    # other variables (DeepSeek-V3's MoEBiasVar routing bias) at 0
    layer_at: int | str = "param_scan_axis"
    # ``source`` is HF tensors joined (MaxText's Qwen3.5 ``in_proj_qkvz``): Rule.join
    join: Join | None = None


@dataclass(frozen=True)
class LayerGroup:
    """Decoder layers of one kind: the scanned subtree (each leaf stacking all of them, the layer
    axis at ``param_scan_axis``), the unscanned one (``{layer}`` the index within the group), their
    number (an expression over the hook config) and the HF layer position ``i`` reads (``offsets`` /
    ``indices`` as :class:`~otfload.plan.mapping.Rule` takes them)."""

    scanned: str
    unscanned: str
    leaves: tuple[Leaf, ...]
    count: str = "mt_num_decoder_layers"
    offsets: Mapping[str, int | str] = field(default_factory=dict)
    indices: Mapping[str, Stride | Composed] = field(default_factory=dict)
    # a group stacked twice (MaxText's scanned Qwen3-Next): ``local`` layers (an expression) in each of
    # ``count`` blocks, the leaf ``[blocks, local]`` at ``param_scan_axis`` and the next dimension
    local: str | None = None
    # unscanned layers of several kinds: the HF layers (= path indices) that hold this group's leaves,
    # the first ``count`` of these strides' values together; none: ``0 .. count-1``
    at: tuple[Stride, ...] = ()

    def prefix(self, scan_layers: bool) -> str:
        return self.scanned if scan_layers else self.unscanned

    def layers(self, config: Mapping[str, Any]) -> int:
        """How many layers (blocks, for a group stacked twice) the group has for the hook config ``config``."""
        return integer(self.count, config, f"layer count of {self.scanned}")

    def path_layers(self, config: Mapping[str, Any]) -> list[int]:
        """The values ``{layer}`` takes in this group's paths (``decoder.layers_<i>``)."""
        count = self.layers(config)
        if not self.at:
            return list(range(count))
        return sorted({v for stride in self.at for v in stride.values(config)[:count]})[:count]

    def stack_sizes(self, config: Mapping[str, Any]) -> dict[str, int]:
        """The size of each layer stack axis of the group's scanned leaves."""
        if self.local is None:
            return {"layer": self.layers(config)}
        return {BLOCK: self.layers(config), LOCAL: integer(self.local, config, f"local layers of {self.scanned}")}

    def rules(self, scan_layers: bool, config: Mapping[str, Any] | None = None) -> list[Rule]:
        """The group's rules; unscanned with ``at``, each matching only the group's layers (kinds of
        layers at the same leaf paths: Gemma 4's sliding and global attention): :meth:`path_layers` for
        the hook config ``config``, or without one ``at``'s strides (literal ones only)."""
        prefix = self.prefix(scan_layers)
        at = self.at if config is None else tuple(self.path_layers(config))
        only = {"layer": at} if self.at and not scan_layers else {}
        return [Rule(f"{prefix}.{leaf.path}", leaf.source, leaf.hooks, offsets=self.offsets, indices=self.indices,
                     stack_at=self._stack_at(leaf), join=leaf.join, only=only) for leaf in self.leaves]

    def _stack_at(self, leaf: Leaf) -> dict[str, int | str]:
        if self.local is None:
            return {"layer": leaf.layer_at}
        return {BLOCK: leaf.layer_at, LOCAL: f"{leaf.layer_at} + 1"}


def nested_blocks(scanned: str, leaves: tuple[Leaf, ...], period: int, local: int) -> LayerGroup:
    """A group MaxText stacks twice: ``scanned`` leaves ``[blocks, local]``, block ``b``'s position
    ``l`` the HF layer ``b * period + l`` (``local`` < ``period`` positions of each block)."""
    return LayerGroup(scanned, scanned, leaves, f"mt_num_decoder_layers // {period}",
                      indices={"layer": Composed((BLOCK, LOCAL), f"{BLOCK} * {period} + {LOCAL}")}, local=str(local))


def decoder_layers(*leaves: Leaf) -> tuple[LayerGroup, ...]:
    """The one group of a model whose layers are all alike (``decoder.layers``)."""
    return (LayerGroup(SCANNED, UNSCANNED, leaves),)


CYCLE = "mt_inhomogeneous_layer_cycle_interval"


def cycle_table(name: str, model_type: str, leaves: tuple[Leaf, ...], period: int) -> ModelTable:
    """A model whose layers MaxText scans in a cycle of ``inhomogeneous_layer_cycle_interval``
    (``period``, the only value the table is written for) layers: GPT-OSS (2), OLMo 3 (4)."""
    return ModelTable(name=name, model_types=frozenset({model_type}), top=top_leaves(),
                      groups=block_groups(leaves, period, CYCLE), unscanned=decoder_layers(*leaves),
                      fixed={"inhomogeneous_layer_cycle_interval": period})


def block_groups(leaves: tuple[Leaf, ...], blocks: int, period: int | str) -> tuple[LayerGroup, ...]:
    """A scanned repeating block of ``blocks`` layers (``period``, a number or a field, as many):
    ``decoder.layers.layers_<j>`` stacks HF layers ``j, j + period, ...``, ``num_decoder_layers //
    period`` of them (GPT-OSS's, OLMo 3's cycle, Gemma 3's six)."""
    return tuple(LayerGroup(f"{SCANNED}.layers_{j}", f"{SCANNED}.layers_{j}", leaves,
                            f"mt_num_decoder_layers // {period}", indices={"layer": Stride(period, j)})
                 for j in range(blocks))


@dataclass(frozen=True)
class ExtraLayer:
    """A layer beside the decoder stack that a tree has when the MaxText field ``field`` is 1
    (DeepSeek-V3's multi-token-prediction layer: ``mtp_num_layers``): its leaves unstacked in every
    layout, ``{mtp}`` the path's 1-based index, reading HF layer ``first`` (an expression) for index 1."""

    field: str
    leaves: tuple[Leaf, ...]
    first: str

    def rules(self) -> list[Rule]:
        return [Rule(leaf.path, leaf.source, leaf.hooks, indices={"mtp": Stride(1, f"{self.first} - 1")})
                for leaf in self.leaves]

    def paths(self) -> list[str]:
        """The leaf paths of the one layer (index 1)."""
        return [leaf.path.replace("{mtp}", "1") for leaf in self.leaves]


@dataclass(frozen=True)
class ModelTable:
    """A MaxText model's table: the leaves outside the layers, the layer groups of the scanned and
    of the unscanned tree (``unscanned`` ``None``: the same groups), the MaxText fields its shapes
    and hooks use beyond the common ones (and those it needs at one value), and the HF
    ``model_type`` s whose checkpoints it reads."""

    name: str
    model_types: frozenset[str]
    top: tuple[Leaf, ...]
    groups: tuple[LayerGroup, ...]
    unscanned: tuple[LayerGroup, ...] | None = None
    fields: tuple[str, ...] = ()
    # MaxText fields whose value the table is written for (GPT-OSS's two-layer scanned block)
    fixed: Mapping[str, int] = field(default_factory=dict)
    # checkpoint config fields its hooks read, as ``hf_<field>`` (from ``text_config`` where there is one)
    hf_fields: tuple[str, ...] = ()
    extras: tuple[ExtraLayer, ...] = ()
    # MaxText booleans its shapes use, as 0 or 1 (absent: false; Gemma 4 E2B's use_double_wide_mlp)
    flags: tuple[str, ...] = ()

    def layer_groups(self, scan_layers: bool) -> tuple[LayerGroup, ...]:
        return self.groups if scan_layers or self.unscanned is None else self.unscanned

    @property
    def moe(self) -> bool:
        """Whether any layer reads experts (the MoE fields are then needed)."""
        return any("expert" in leaf.source for g in (*self.groups, *(self.unscanned or ())) for leaf in g.leaves)

    def mapping(self, scan_layers: bool, config: Mapping[str, Any] | None = None) -> MappingTable:
        """The otfload mapping table for the scanned or the unscanned tree (its groups' layers resolved
        against the hook config ``config``: :meth:`LayerGroup.rules`)."""
        rules = [Rule(leaf.path, leaf.source, leaf.hooks) for leaf in self.top]
        for group in self.layer_groups(scan_layers):
            rules += group.rules(scan_layers, config)
        for extra in self.extras:
            rules += extra.rules()
        return MappingTable(tuple(rules), ignore=(r".*rotary_emb\.inv_freq",))


def kernel(name: str, source: str, shape: tuple[str, ...], axes: tuple[str | None, ...],
           extra: tuple[Hook, ...] = ()) -> Leaf:
    """An HF ``[out, in]`` projection as MaxText's ``[in, out]`` kernel with ``shape`` (heads split)."""
    split = (Reshape(shape),) if len(shape) > 2 else ()
    return Leaf(name, source, (T, *split, *extra), shape, axes)


def norm(name: str, source: str, size: str = "mt_emb_dim") -> Leaf:
    """An RMSNorm scale as it is stored."""
    return Leaf(name, source, (), (size,), ("tensor",))


def top_leaves() -> tuple[Leaf, ...]:
    """The embedding (padded to MaxText's ``vocab_size`` with zeros, as MaxText's converter pads it),
    the final norm and the output kernel padded alike (a tree with ``logits_via_embedding`` has none)."""
    def pad(axis: int) -> Pad:
        return Pad(axis, "mt_vocab_size", original="hf_vocab_size")

    return (
        Leaf("token_embedder.embedding", "model.embed_tokens.weight", (pad(0),), ("mt_vocab_size", "mt_emb_dim"),
             ("tensor", "fsdp")),
        norm("decoder.decoder_norm.scale", "model.norm.weight"),
        Leaf(LOGITS, "lm_head.weight", (T, pad(1)),
             ("mt_emb_dim", "mt_vocab_size"), ("fsdp", "tensor")),
    )


def interleave_rope(heads: str) -> tuple[Hook, ...]:
    """HF's rotate-half order within each head (``[x_0 .. x_{d/2-1}, y_0 .. y_{d/2-1}]``) to MaxText's
    interleaved pairs (``[x_0, y_0, x_1, y_1, ...]``) of its Llama 3.1 RoPE, on ``[embed, heads * head_dim]``."""
    return (Reshape(("mt_emb_dim", heads, 2, "mt_head_dim // 2")), Transpose((0, 1, 3, 2)),
            Reshape(("mt_emb_dim", heads, "mt_head_dim")))


QUERY_SCALE = Scale("1 / sqrt(mt_head_dim)")  # MaxText's converter: float32(1 / np.sqrt(head_dim))
Q_SHAPE = ("mt_emb_dim", "mt_num_query_heads", "mt_head_dim")
KV_SHAPE = ("mt_emb_dim", "mt_num_kv_heads", "mt_head_dim")
O_SHAPE = ("mt_num_query_heads", "mt_head_dim", "mt_emb_dim")
QKV_AXES = ("fsdp", "tensor", None)
O_AXES = ("tensor", None, "fsdp")
ATTN = f"{HF_LAYER}.self_attn"


def attention(rope_interleaved: bool, query_scaled: bool, module: str = "self_attention") -> tuple[Leaf, ...]:
    """The GQA attention projections of MaxText's attention ``module``, q/k with MaxText's RoPE order
    and the query pre-scaled by ``1/sqrt(head_dim)`` where the model's converter does either."""
    scale = (QUERY_SCALE,) if query_scaled else ()
    if rope_interleaved:
        q = Leaf(f"{module}.query.kernel", f"{ATTN}.q_proj.weight",
                 (T, *interleave_rope("mt_num_query_heads"), *scale), Q_SHAPE, QKV_AXES)
        k = Leaf(f"{module}.key.kernel", f"{ATTN}.k_proj.weight", (T, *interleave_rope("mt_num_kv_heads")),
                 KV_SHAPE, QKV_AXES)
    else:
        q = kernel(f"{module}.query.kernel", f"{ATTN}.q_proj.weight", Q_SHAPE, QKV_AXES, scale)
        k = kernel(f"{module}.key.kernel", f"{ATTN}.k_proj.weight", KV_SHAPE, QKV_AXES)
    return (
        q, k,
        kernel(f"{module}.value.kernel", f"{ATTN}.v_proj.weight", KV_SHAPE, QKV_AXES),
        kernel(f"{module}.out.kernel", f"{ATTN}.o_proj.weight", O_SHAPE, O_AXES),
    )


def attention_biases(module: str = "self_attention") -> tuple[Leaf, ...]:
    """Qwen2's (GPT-OSS's) q/k/v biases, HF's ``[heads * head_dim]`` split into MaxText's ``[heads, head_dim]``."""
    def bias(name: str, source: str, heads: str) -> Leaf:
        return Leaf(f"{module}.{name}.bias", f"{ATTN}.{source}.bias", (Reshape((heads, "mt_head_dim")),),
                    (heads, "mt_head_dim"), ("tensor", None))

    return (bias("query", "q_proj", "mt_num_query_heads"), bias("key", "k_proj", "mt_num_kv_heads"),
            bias("value", "v_proj", "mt_num_kv_heads"))


def layer_norms() -> tuple[Leaf, ...]:
    """The two pre-norms of a layer."""
    return (norm("pre_self_attention_layer_norm.scale", f"{HF_LAYER}.input_layernorm.weight"),
            norm("post_self_attention_layer_norm.scale", f"{HF_LAYER}.post_attention_layernorm.weight"))


def qk_norms() -> tuple[Leaf, ...]:
    """Qwen3's per-head q and k RMSNorm scales."""
    return (norm("self_attention.query_norm.scale", f"{ATTN}.q_norm.weight", "mt_head_dim"),
            norm("self_attention.key_norm.scale", f"{ATTN}.k_norm.weight", "mt_head_dim"))


def dense_mlp(module: str = "mlp", mlp: str = f"{HF_LAYER}.mlp", width: str = "mt_mlp_dim") -> tuple[Leaf, ...]:
    """A gated MLP (MaxText's ``module``, HF's ``mlp``, ``width`` wide): ``wi_0`` the gate, ``wi_1``
    the up projection, ``wo`` the down projection."""
    inner, outer = ("mt_emb_dim", width), (width, "mt_emb_dim")
    return (kernel(f"{module}.wi_0.kernel", f"{mlp}.gate_proj.weight", inner, ("fsdp", "tensor")),
            kernel(f"{module}.wi_1.kernel", f"{mlp}.up_proj.weight", inner, ("fsdp", "tensor")),
            kernel(f"{module}.wo.kernel", f"{mlp}.down_proj.weight", outer, ("tensor", "fsdp")))


def routed_experts(block: str, router: str, experts: str, names: tuple[str, str, str]) -> tuple[Leaf, ...]:
    """A MoE block ``block`` (MaxText's module name): the router kernel ``[embed, experts]`` and the
    expert kernels stacked over ``{expert}`` (``[experts, embed, mlp]`` per layer); ``names`` are
    the HF gate, up and down projections under ``experts``."""
    gate, up, down = (f"{experts}.{{expert}}.{n}.weight" for n in names)
    inner, outer = ("mt_emb_dim", "mt_moe_mlp_dim"), ("mt_moe_mlp_dim", "mt_emb_dim")
    return (kernel(f"{block}.gate.kernel", router, ("mt_emb_dim", "mt_num_experts"), ("fsdp", None)),
            kernel(f"{block}.wi_0", gate, inner, ("fsdp", "tensor")),
            kernel(f"{block}.wi_1", up, inner, ("fsdp", "tensor")),
            kernel(f"{block}.wo", down, outer, ("tensor", "fsdp")))


def slice_shape(leaf: Leaf, config: Mapping[str, Any]) -> tuple[int, ...]:
    """One slice of ``leaf`` (no stack axes) for the MaxText fields (or expressions of them) in ``config``."""
    return tuple(integer(name, config, f"shape of {leaf.path}") for name in leaf.shape)
