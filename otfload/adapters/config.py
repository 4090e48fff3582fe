"""``adapter_config.json`` of a PEFT LoRA adapter: the fields the merge needs, validated.

Every field the merged weights depend on is checked for its type; every feature whose merge is not
``W + s·B@A`` (DoRA, LoRA biases, ``fan_in_fan_out``, layer replication, trainable tokens, the LoRA
variants that change the forward pass) is an :class:`~otfload.errors.AdapterError` naming the
field, never silently ignored. Fields that only say how the adapter was *trained* or *initialised*
(``lora_dropout``, ``init_lora_weights``, ``target_modules``, ``layers_to_transform``, ...) do not
change the merge: the tensors present decide what is adapted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, TypeGuard, TypeVar

from otfload.errors import AdapterError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
LORA = "LORA"
# Fields whose truthy value means a merge otfload does not do (PEFT's name → what it is).
UNSUPPORTED_FLAGS = {
    "use_dora": "DoRA (weight-decomposed LoRA: the merge rescales by a magnitude vector)",
    "lora_bias": "LoRA biases on lora_B",
    "fan_in_fan_out": "fan_in_fan_out (weights stored [in, out], GPT-2 Conv1D)",
    "layer_replication": "layer replication (layers duplicated before adaptation)",
    "trainable_token_indices": "trainable tokens (per-token embedding deltas)",
    "use_qalora": "QA-LoRA (pooled inputs)",
    "use_bdlora": "BD-LoRA (block-diagonal factors)",
    "velora_config": "the VeLoRA variant",
    "alora_invocation_tokens": "activated LoRA (applied only after its invocation tokens)",
    "monteclora_config": "the MonteCLoRA variant",
    "arrow_config": "Arrow routing between adapters",
    "kasa_config": "the KaSA variant (a diagonal between A and B)",
}
# ``init_lora_weights`` values that are LoRA variants (a different forward), not initialisations.
VARIANT_INITS = frozenset({"mica"})

T = TypeVar("T")


def _fail(where: str, field_name: str, message: str) -> AdapterError:
    return AdapterError(f"adapter {where}: {CONFIG_FILE} field {field_name!r}: {message}")


def _is_int(x: object) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_positive_int(x: object) -> TypeGuard[int]:
    return _is_int(x) and x > 0


def _is_number(x: object) -> TypeGuard[float]:
    return (_is_int(x) or isinstance(x, float)) and math.isfinite(x)


@lru_cache(maxsize=256)
def _pattern(key: str) -> re.Pattern[str]:
    # PEFT's ``get_pattern_key``: the key, as a regex, must match a dotted suffix of the module name.
    return re.compile(rf"(.*\.)?({key})$")


@dataclass(frozen=True)
class AdapterConfig:
    """The merge-relevant fields of one ``adapter_config.json`` (``where`` names the adapter)."""

    where: str
    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()
    modules_to_save: tuple[str, ...] = ()
    base_model_name_or_path: str | None = None
    revision: str | None = None
    ensure_weight_tying: bool = False
    base_model_class: str | None = None

    def rank_and_alpha(self, key: str) -> tuple[int, float]:
        """``(r, alpha)`` of the module or parameter ``key``, as PEFT resolves them: the first
        ``rank_pattern`` / ``alpha_pattern`` entry (in file order) whose regex matches a dotted suffix
        of ``key``, else the global ``r`` / ``lora_alpha``."""
        r = next((v for k, v in self.rank_pattern.items() if _pattern(k).match(key)), self.r)
        alpha = next((v for k, v in self.alpha_pattern.items() if _pattern(k).match(key)), self.lora_alpha)
        return r, alpha

    def scale(self, key: str) -> tuple[int, float]:
        """``(r, s)`` of ``key``: the merge adds ``s·B@A`` with ``s = alpha/r`` (``alpha/√r`` with rsLoRA)."""
        r, alpha = self.rank_and_alpha(key)
        return r, alpha / (math.sqrt(r) if self.use_rslora else r)

    def targets_parameter(self, key: str) -> bool:
        """Whether ``key`` (``module.param``) is one of ``target_parameters``, matched as PEFT does
        (equal, or ending with ``"." + target``)."""
        return any(key == t or key.endswith(f".{t}") for t in self.target_parameters)


def _str_list(raw: Mapping[str, Any], name: str, where: str) -> tuple[str, ...]:
    value = raw.get(name)
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(where, name, f"{value!r} is not a list of strings or null")
    return tuple(value)


def _patterns(
    raw: Mapping[str, Any], name: str, where: str, check: Callable[[object], TypeGuard[T]], rule: str
) -> dict[str, T]:
    value = raw.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _fail(where, name, f"{value!r} is not an object")
    for key, v in value.items():
        if not check(v):
            raise _fail(where, name, f"entry {key!r}: {v!r} is not {rule}")
        try:
            _pattern(key)
        except re.error as e:
            raise _fail(where, name, f"entry {key!r} is not a valid regex ({e})") from None
    return dict(value)


def _optional_str(raw: Mapping[str, Any], name: str, where: str) -> str | None:
    value = raw.get(name)
    if value is not None and not isinstance(value, str):
        raise _fail(where, name, f"{value!r} is not a string or null")
    return value or None


def parse_adapter_config(raw: object, where: str) -> AdapterConfig:
    """Validate a parsed ``adapter_config.json``; ``where`` (the adapter's location) prefixes errors."""
    if not isinstance(raw, dict):
        raise AdapterError(f"adapter {where}: {CONFIG_FILE} is not a JSON object")
    peft_type = raw.get("peft_type")
    if peft_type != LORA:
        raise _fail(where, "peft_type", f"{peft_type!r}: only LoRA adapters ({LORA!r}) are merged")
    for name, what in UNSUPPORTED_FLAGS.items():
        if raw.get(name):
            raise _fail(where, name, f"{raw[name]!r}: {what} is not supported")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise _fail(where, "bias", f"{bias!r}: trained biases are not supported (only 'none')")
    init = raw.get("init_lora_weights")
    if isinstance(init, str) and init in VARIANT_INITS:
        raise _fail(where, "init_lora_weights", f"{init!r} is a LoRA variant, not supported")
    r = raw.get("r")
    if not _is_positive_int(r):
        raise _fail(where, "r", f"{r!r} is not a positive integer")
    alpha = raw.get("lora_alpha", 8)  # PEFT's default
    if not _is_number(alpha):
        raise _fail(where, "lora_alpha", f"{alpha!r} is not a finite number")
    use_rslora = raw.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        raise _fail(where, "use_rslora", f"{use_rslora!r} is not a boolean")
    tying = raw.get("ensure_weight_tying", False)
    if not isinstance(tying, bool):
        raise _fail(where, "ensure_weight_tying", f"{tying!r} is not a boolean")
    auto_mapping = raw.get("auto_mapping")
    base_class = auto_mapping.get("base_model_class") if isinstance(auto_mapping, dict) else None
    return AdapterConfig(
        where=where,
        r=r,
        lora_alpha=alpha,
        use_rslora=use_rslora,
        rank_pattern=_patterns(raw, "rank_pattern", where, _is_positive_int, "a positive integer"),
        alpha_pattern=_patterns(raw, "alpha_pattern", where, _is_number, "a finite number"),
        target_parameters=_str_list(raw, "target_parameters", where),
        modules_to_save=_str_list(raw, "modules_to_save", where),
        base_model_name_or_path=_optional_str(raw, "base_model_name_or_path", where),
        revision=_optional_str(raw, "revision", where),
        ensure_weight_tying=tying,
        base_model_class=base_class if isinstance(base_class, str) else None,
    )


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "AdapterConfig", "parse_adapter_config"]
