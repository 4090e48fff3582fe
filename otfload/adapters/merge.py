"""Merge PEFT LoRA adapters into a checkpoint index, from headers alone.

Each adapter's tensors decide what is adapted (``base_model.model.`` prefix stripped):

- ``<module>.lora_A.weight`` ``[r, in]`` + ``<module>.lora_B.weight`` ``[out, r]``: a LoRA on the
  module's ``weight``; ``<module>.lora_embedding_A`` ``[r, vocab]`` + ``lora_embedding_B``
  ``[hidden, r]``: a LoRA on an embedding (delta transposed);
- ``<module>(.base_layer)*.lora_A.weight`` where ``<module>.<param>`` is one of the config's
  ``target_parameters``: a LoRA on a parameter (PEFT's ``ParamWrapper``). Several targeted parameters
  of one module nest, the first registered innermost (``gate_up_proj`` under
  ``experts.base_layer.lora_A``, ``down_proj`` under ``experts.lora_A``). 3-D expert parameters hold
  every expert in one pair of factors (see :mod:`otfload.adapters.tensor`);
- ``<module>.base_layer.weight``: the module's base weight, saved by PEFT with an adapted embedding;
  it replaces the base tensor (tied embeddings: both uses);
- any other ``<module>.<param>`` (``modules_to_save``): replaces that base tensor.

A module whose key is not in the checkpoint is looked up under the checkpoint's names: transformers
5 renames some modules and fuses per-expert weights at load time (Mixtral's ``block_sparse_moe`` is
``mlp``; ``experts.gate_up_proj`` ``[E, 2·I, H]`` is ``experts.{e}.w1`` and ``w3`` stacked), so an
adapter trained on transformers 5 names parameters the stored checkpoint splits. Each family states
how in its :attr:`~otfload.families.registry.Family.lora_layout` (:mod:`otfload.families.lora`). A fused factor pair
then becomes one term per stored expert tensor (its ``A`` rows, its ``B`` rows and expert columns).

Adapters apply in order, as PEFT's merge-then-load would: a replaced tensor drops the deltas merged
into it before. A tied embedding/head that an adapter changes is untied the way PEFT's wrappers
untie it: the adapted module gets the change, the other keeps the base weight.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from otfload.adapters.config import AdapterConfig
from otfload.adapters.tensor import AdaptedTensor, LoraTerm
from otfload.errors import AdapterError
from otfload.families.lora import ExpertLayout
from otfload.families.registry import find_family
from otfload.index.checkpoint import CheckpointIndex
from otfload.index.derived import DerivedTensor, is_derived
from otfload.index.header import TensorInfo
from otfload.plan.planner import LoadPlan

PEFT_PREFIX = "base_model.model."
NESTED = ".base_layer"
# key suffix -> (factor, embedding)
LORA_SUFFIXES = {
    ".lora_A.weight": ("A", False),
    ".lora_B.weight": ("B", False),
    ".lora_embedding_A": ("A", True),
    ".lora_embedding_B": ("B", True),
}
# transformers 5 registers expert parameters in this order, and PEFT nests the wrappers of several
# targeted parameters of one module in registration order (the first one innermost); ungated experts
# (Nemotron-H) have up_proj where the others have gate_up_proj.
PARAMETER_ORDER = ("weight", "gate_up_proj", "gate_up_proj_bias", "up_proj", "down_proj", "down_proj_bias")
# (embedding, head) keys of the tied pair; a checkpoint with the embedding and no head is tied.
TIED_PAIRS = (("model.embed_tokens.weight", "lm_head.weight"),)


@dataclass(frozen=True)
class Adapter:
    """One opened adapter: its position, location, config and tensors (names without the PEFT
    prefix, files in the combined source's namespace)."""

    index: int
    where: str
    config: AdapterConfig
    tensors: dict[str, TensorInfo]


def lora_layout(model_type: object) -> ExpertLayout:
    """The LoRA layout of ``model_type``'s family; none (names as stored) for a model type that no
    family registers (a checkpoint loaded with the caller's own mapping table)."""
    family = find_family(model_type) if isinstance(model_type, str) else None
    return ExpertLayout() if family is None else family.lora_layout


def strip_prefix(key: str) -> str:
    return key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key


def _is_float(info: TensorInfo | DerivedTensor) -> bool:
    if is_derived(info):
        return True
    return info.dtype.kind == "V" or (np.issubdtype(info.dtype, np.floating) and "float8" not in info.dtype.name)


class _Merger:
    """The index's tensors while adapters are merged into it, one adapter at a time."""

    def __init__(self, index: CheckpointIndex):
        self.tensors: dict[str, TensorInfo | DerivedTensor] = dict(index.tensors)
        self.config = dict(index.config)
        self.layout = lora_layout(self.config.get("model_type"))
        self.children: dict[str, set[str]] = defaultdict(set)
        for key in self.tensors:
            parent, _, name = key.rpartition(".")
            self.children[parent].add(name)
        self.tied = {head: embed for embed, head in TIED_PAIRS if embed in self.tensors and head not in self.tensors}

    # --- names -------------------------------------------------------------------------------------

    def stored_names(self, key: str) -> list[str]:
        """``key`` and its names under the layout's renames, each applied to the names before it (a
        module renamed and under a checkpoint's own prefix: DeepSeek-V4's release)."""
        names = [key]
        for runtime, stored in self.layout.renames:
            names += [name.replace(runtime, stored) for name in names if runtime in name]
        return names

    def find(self, key: str, adapter: Adapter) -> str | None:
        """The checkpoint key of ``key`` (untying a tied head that ``key`` names)."""
        for name in self.stored_names(key):
            if name in self.tensors:
                return name
            if name in self.tied:
                self.untie(name, adapter)
                return name
        return None

    def untie(self, head: str, adapter: Adapter) -> None:
        """Give a tied head its own entry (the embedding as it is now) and untie the config."""
        if head not in self.tied:
            return
        if adapter.config.ensure_weight_tying:
            raise AdapterError(
                f"adapter {adapter.where}: ensure_weight_tying with an adapted tied embedding/head "
                f"({head!r}) is not supported"
            )
        embed = self.tensors[self.tied.pop(head)]
        self.tensors[head] = embed._replace(name=head) if isinstance(embed, TensorInfo) else embed
        parent, _, name = head.rpartition(".")
        self.children[parent].add(name)
        self.config["tie_word_embeddings"] = False

    def modify(self, key: str, adapter: Adapter) -> None:
        """About to change ``key``: untie it first if it is the embedding of a tied pair."""
        for head, embed in list(self.tied.items()):
            if embed == key:
                self.untie(head, adapter)

    def expert_keys(self, container: str, part: str) -> list[str]:
        """``container.{e}.part.weight`` for e = 0, 1, ... while the checkpoint has them."""
        keys: list[str] = []
        while f"{container}.{len(keys)}.{part}.weight" in self.tensors:
            keys.append(f"{container}.{len(keys)}.{part}.weight")
        return keys

    def fused_parts(self, container: str, param: str) -> tuple[str, list[list[str]]] | None:
        """For a fused runtime expert parameter: the stored container and, per part, its expert keys."""
        parts = dict(self.layout.fused).get(param)
        if parts is None:
            return None
        for stored in self.stored_names(container):
            keys = [self.expert_keys(stored, part) for part in parts]
            if keys[0] and all(len(k) == len(keys[0]) for k in keys):
                return stored, keys
        return None

    def parameters(self, container: str) -> list[str]:
        """The parameters ``container`` has at runtime, in registration order."""
        names = set()
        for stored in self.stored_names(container):
            names |= self.children.get(stored, set())
        names |= {param for param, _ in self.layout.fused if self.fused_parts(container, param)}
        rank = {p: i for i, p in enumerate(PARAMETER_ORDER)}
        return sorted(names, key=lambda p: (rank.get(p, len(rank)), p))

    # --- one adapter -------------------------------------------------------------------------------

    def apply(self, adapter: Adapter) -> None:
        pairs: dict[tuple[str, bool], dict[str, TensorInfo]] = defaultdict(dict)
        replaced_base, replaced = {}, {}
        for key, info in adapter.tensors.items():
            suffix = next((s for s in LORA_SUFFIXES if key.endswith(s)), None)
            if suffix is not None:
                factor, embedding = LORA_SUFFIXES[suffix]
                pairs[(key[: -len(suffix)], embedding)][factor] = info
            elif ".lora_" in key:
                raise AdapterError(f"adapter {adapter.where}: tensor {key!r} is not a LoRA factor otfload merges "
                                   "(DoRA magnitudes, LoRA biases and other variants are not supported)")
            elif key.endswith(NESTED + ".weight") and key.count(NESTED) == 1:
                replaced_base[key.replace(NESTED, "")] = info
            else:
                replaced[key] = info
        for key, info in {**replaced_base, **replaced}.items():
            self.replace(key, info, adapter, untie=key in replaced)
        for (module, embedding), factors in sorted(pairs.items()):
            self.add_lora(module, embedding, factors, adapter)

    def replace(self, key: str, info: TensorInfo, adapter: Adapter, untie: bool) -> None:
        target = self.find(key, adapter)
        if target is None:
            raise AdapterError(f"adapter {adapter.where}: tensor {key!r} replaces a module the base checkpoint "
                               "does not have (modules_to_save of another architecture?)")
        base = self.tensors[target]
        if info.shape != base.shape or not _is_float(info):
            raise AdapterError(f"adapter {adapter.where}: tensor {key!r} is {info.dtype}{list(info.shape)}, but it "
                               f"replaces {target!r}, a float tensor of shape {list(base.shape)}")
        if untie:
            self.modify(target, adapter)
        self.tensors[target] = info._replace(name=target)

    def _param_of(self, module: str, adapter: Adapter) -> tuple[str, str, bool]:
        """``(container, parameter, targeted)`` of a LoRA on ``module`` (which may nest base_layers)."""
        container, depth = module, 0
        while container.endswith(NESTED):
            container, depth = container[: -len(NESTED)], depth + 1
        cfg = adapter.config
        targeted = []
        if cfg.target_parameters:
            targeted = [p for p in self.parameters(container) if cfg.targets_parameter(f"{container}.{p}")]
        if targeted:
            if depth >= len(targeted):
                raise AdapterError(f"adapter {adapter.where}: module {module!r}: {depth} nested base_layer(s) but "
                                   f"target_parameters match only {targeted} of {container!r}")
            return container, targeted[len(targeted) - 1 - depth], True
        if depth:
            raise AdapterError(f"adapter {adapter.where}: module {module!r} wraps a parameter that no "
                               f"target_parameters entry ({list(cfg.target_parameters)}) names")
        return container, "weight", False

    def add_lora(self, module: str, embedding: bool, factors: dict[str, TensorInfo], adapter: Adapter) -> None:
        where = f"adapter {adapter.where}: module {module!r}"
        if set(factors) != {"A", "B"}:
            missing = "lora_B" if "A" in factors else "lora_A"
            raise AdapterError(f"{where}: has no {missing} tensor")
        a, b = factors["A"], factors["B"]
        if len(a.shape) != 2 or len(b.shape) != 2 or not (_is_float(a) and _is_float(b)):
            raise AdapterError(f"{where}: lora_A {a.dtype}{list(a.shape)} and lora_B {b.dtype}{list(b.shape)} "
                               "must be 2-D float tensors")
        container, param, targeted = self._param_of(module, adapter)
        key = f"{container}.{param}"
        r, scale = adapter.config.scale(key if targeted else container)
        target = self.find(key, adapter)
        if target is not None:
            terms = self._direct_terms(target, a, b, r, scale, embedding, targeted, where)
        elif targeted and (fused := self.fused_parts(container, param)) is not None:
            terms = self._fused_terms(fused[1], a, b, r, scale, where)
        else:
            raise AdapterError(f"{where}: the base checkpoint has no tensor {key!r} (an adapter for another "
                               f"architecture? adapter_config.json names base_model_name_or_path="
                               f"{adapter.config.base_model_name_or_path!r})")
        for name, term in terms:
            base = self.tensors[name]
            if not _is_float(base):
                raise AdapterError(f"{where}: base tensor {name!r} is {base.dtype}, not a float weight")
            self.modify(name, adapter)
            if isinstance(base, AdaptedTensor):
                self.tensors[name] = dataclasses.replace(base, terms=(*base.terms, term))
            else:
                self.tensors[name] = AdaptedTensor(base, (term,))

    @staticmethod
    def _check_factors(where: str, a: TensorInfo, b: TensorInfo, r: int, experts: int, inp: int, out: int,
                       shape: tuple[int, ...]) -> None:
        rank = experts * r
        if a.shape[0] != b.shape[1]:
            raise AdapterError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} disagree on the rank")
        if a.shape[0] != rank:
            per = f" ({experts} experts x r)" if experts > 1 else ""
            raise AdapterError(f"{where}: field r (with rank_pattern) is {r}, but lora_A {list(a.shape)} has rank "
                               f"{a.shape[0]}{per}; expected {rank}")
        if (a.shape[1], b.shape[0]) != (inp, out):
            raise AdapterError(f"{where}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit the base "
                               f"tensor {list(shape)} (needs lora_A [{rank}, {inp}], lora_B [{out}, {rank}])")

    def _direct_terms(self, target: str, a: TensorInfo, b: TensorInfo, r: int, scale: float, embedding: bool,
                      targeted: bool, where: str) -> list[tuple[str, LoraTerm]]:
        shape = self.tensors[target].shape
        if len(shape) == 2:
            out, inp = (shape[1], shape[0]) if embedding else shape
            self._check_factors(where, a, b, r, 1, inp, out, shape)
            return [(target, LoraTerm(a, b, r, scale, transposed=embedding))]
        if len(shape) == 3 and targeted and not embedding:
            experts, d1, d2 = shape
            inp, out = (d1, d2) if self.layout.transposed else (d2, d1)
            self._check_factors(where, a, b, r, experts, inp, out, shape)
            return [(target, LoraTerm(a, b, r, scale, transposed=self.layout.transposed, experts=experts))]
        raise AdapterError(f"{where}: base tensor {target!r} {list(shape)} is not a 2-D weight or a targeted 3-D "
                           "expert parameter")

    def _fused_terms(self, parts: list[list[str]], a: TensorInfo, b: TensorInfo, r: int, scale: float,
                     where: str) -> list[tuple[str, LoraTerm]]:
        experts = len(parts[0])
        first = self.tensors[parts[0][0]].shape
        outs = [self.tensors[keys[0]].shape[0] for keys in parts]
        fused_shape = (experts, sum(outs), first[1])
        if self.layout.transposed:
            raise AdapterError(f"{where}: transposed fused experts stored per expert are not supported")
        self._check_factors(where, a, b, r, experts, first[1], sum(outs), fused_shape)
        terms = []
        offset = 0
        for keys, out in zip(parts, outs, strict=True):
            for e, key in enumerate(keys):
                shape = self.tensors[key].shape
                if shape != (out, first[1]):
                    raise AdapterError(f"{where}: expert tensor {key!r} {list(shape)} differs from the other experts' "
                                       f"{[out, first[1]]}")
                terms.append((key, LoraTerm(a, b, r, scale, experts=experts, expert=e, out_offset=offset)))
            offset += out
        return terms


def merge_adapters(index: CheckpointIndex, adapters: Sequence[Adapter]) -> CheckpointIndex:
    """``index`` with every adapter merged in, in order (headers only; no tensor byte is read)."""
    merger = _Merger(index)
    for adapter in adapters:
        merger.apply(adapter)
    return dataclasses.replace(index, tensors=merger.tensors, config=merger.config)


def is_adapted(info: TensorInfo | DerivedTensor) -> bool:
    """Whether an index entry comes from an adapter (merged LoRA or a replaced tensor)."""
    return isinstance(info, AdaptedTensor) or (isinstance(info, TensorInfo) and info.file.startswith("@adapter"))


def check_adapted_are_mapped(plan: LoadPlan, index: CheckpointIndex) -> None:
    """Raise if an adapted tensor feeds no leaf: the family does not map that module, so loading
    without it would silently drop part of the adapter."""
    used = {info.name for leaf in plan.leaves.values() for info in leaf.sources}
    dropped = sorted(k for k, info in index.tensors.items() if is_adapted(info) and k not in used)
    if dropped:
        shown = ", ".join(repr(k) for k in dropped[:5]) + (", ..." if len(dropped) > 5 else "")
        raise AdapterError(f"the adapter changes {len(dropped)} tensor(s) that no leaf of the model uses: {shown} "
                           "(the family does not map these modules)")


__all__ = ["Adapter", "check_adapted_are_mapped", "is_adapted", "merge_adapters", "strip_prefix"]
