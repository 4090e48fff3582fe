"""Typed, bounded reading of ``config.json`` fields.

Each family parses its config through :class:`Fields` with one spec per field (:class:`Int`,
:class:`Float`, :class:`Bool`, :class:`Str`, :class:`Choice`, :class:`List`). A value of the wrong
JSON type (``true`` or ``32.0`` where an integer is expected, ``"no"`` where a boolean is), out of
range, or missing when required is a :class:`~otfload.errors.ConfigError` naming the field (dotted
for nested ones), its value and the rule, so nothing past parsing sees a value it cannot use.

The bounds below are far above every released decoder (largest public value in each comment) and
far below what would make otfload enumerate or allocate without end; the tensors actually present
bound the sizes further (:mod:`otfload.config.tensors`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from otfload.errors import ConfigError

# Layers: Llama 3.1 405B has 126; room for 8x deeper models, never a billion layer keys to plan.
MAX_LAYERS = 1024
# Model width: 16384 (Llama 3.1 405B); 8x room.
MAX_HIDDEN = 1 << 17
# Feed-forward width: 53248 (Llama 3.1 405B); 16x room.
MAX_INTERMEDIATE = 1 << 20
# Vocabulary: 262208 (Gemma 3); 16x room.
MAX_VOCAB = 1 << 22
# Attention heads: 128 (Llama 3.1 405B, DeepSeek-V3); 32x room.
MAX_HEADS = 1 << 12
# Per-head and low-rank dims: 256 (Gemma head_dim), 1536 (DeepSeek-V3 q_lora_rank); 8x room.
MAX_HEAD_DIM = 1 << 14
# Routed experts: 384 (Kimi K2), 512 (Qwen3-Next); 32x room, never a billion expert keys to plan.
MAX_EXPERTS = 1 << 14
# Context lengths and windows: 10M tokens (Llama 4 Scout); 13x room.
MAX_CONTEXT = 1 << 27
# RoPE base: 1e6-5e8 in public configs (3.6e9 in long-context fine-tunes); above 1e12 is not a base.
MAX_ROPE_THETA = 1e12
# Multipliers (RoPE scaling factors, softcaps, routed scaling, ...): public values are at most a few
# hundred; above this a value is not a scale but an attack on float range.
MAX_FACTOR = 1e6
# Strings a family compares against names (activations, methods): far longer is not a name.
MAX_NAME_CHARS = 256

REQUIRED: Any = object()  # sentinel: a field with no default


class Spec(Protocol):
    """A field's type and range: ``check`` returns the (normalised) value or raises ConfigError."""

    def describe(self) -> str: ...

    def check(self, field: str, value: object) -> Any: ...


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    return {int: "an integer", float: "a float", str: "a string", list: "a list", dict: "an object"}.get(
        type(value), type(value).__name__
    )


class _BigInt(int):
    """An integer too long for ``repr`` (Python refuses more than 4300 digits): shown by its size."""

    def __repr__(self) -> str:
        return f"<{self.bit_length()}-bit integer>"


def _wrong(spec: Spec, field: str, value: object, why: str = "") -> ConfigError:
    if type(value) is int and value.bit_length() > 4096:  # well below the 4300-digit limit
        value = _BigInt(value)
    return ConfigError(field, value, f"must be {spec.describe()}{why}")


@dataclass(frozen=True)
class Int:
    """A JSON integer in ``[min, max]``; booleans and floats (even ``32.0``) are not integers."""

    min: int = 0
    max: int = MAX_CONTEXT

    def describe(self) -> str:
        return f"an integer in [{self.min}, {self.max}]"

    def check(self, field: str, value: object) -> int:
        if type(value) is not int:
            raise _wrong(self, field, value, f", not {_type_name(value)}")
        if not self.min <= value <= self.max:
            raise _wrong(self, field, value)
        return value


@dataclass(frozen=True)
class Float:
    """A finite JSON number (integer or float, not boolean) in ``[min, max]`` (``(min, max]`` when
    ``exclusive_min``); returned as a Python float."""

    min: float = 0.0
    max: float = MAX_FACTOR
    exclusive_min: bool = False

    def describe(self) -> str:
        return f"a finite number in {'(' if self.exclusive_min else '['}{self.min:g}, {self.max:g}]"

    def check(self, field: str, value: object) -> float:
        if not (type(value) is int or type(value) is float):
            raise _wrong(self, field, value, f", not {_type_name(value)}")
        # Compare before converting: float() of a 400-digit integer overflows.
        if isinstance(value, float) and not math.isfinite(value):
            raise _wrong(self, field, value)
        above = value > self.min if self.exclusive_min else value >= self.min
        if not (above and value <= self.max):
            raise _wrong(self, field, value)
        return float(value)


@dataclass(frozen=True)
class Bool:
    """A JSON boolean: ``"no"``, ``0`` or ``"false"`` are errors, not truthy or falsy values."""

    def describe(self) -> str:
        return "a JSON boolean (true or false)"

    def check(self, field: str, value: object) -> bool:
        if type(value) is not bool:
            raise _wrong(self, field, value, f", not {_type_name(value)}")
        return value


@dataclass(frozen=True)
class Str:
    """A JSON string of at most ``max_chars`` characters."""

    max_chars: int = MAX_NAME_CHARS

    def describe(self) -> str:
        return f"a string of at most {self.max_chars} characters"

    def check(self, field: str, value: object) -> str:
        if not isinstance(value, str) or len(value) > self.max_chars:
            raise _wrong(self, field, value)
        return value


class Choice:
    """One of a fixed set of JSON strings (what otfload implements); anything else is an error."""

    def __init__(self, *options: str):
        self.options = options

    def describe(self) -> str:
        return "one of " + ", ".join(repr(o) for o in self.options)

    def check(self, field: str, value: object) -> str:
        if not isinstance(value, str) or value not in self.options:
            raise _wrong(self, field, value)
        return value


@dataclass(frozen=True)
class List:
    """A JSON list of at most ``max_len`` items, each checked by ``item`` (named ``field[i]``)."""

    item: Spec
    max_len: int = MAX_LAYERS

    def describe(self) -> str:
        return f"a list of at most {self.max_len} items, each {self.item.describe()}"

    def check(self, field: str, value: object) -> tuple[Any, ...]:
        if not isinstance(value, list) or len(value) > self.max_len:
            raise _wrong(self, field, value)
        return tuple(self.item.check(f"{field}[{i}]", v) for i, v in enumerate(value))


@dataclass(frozen=True)
class Object:
    """A JSON object (its fields are read with a nested :class:`Fields`)."""

    def describe(self) -> str:
        return "a JSON object"

    def check(self, field: str, value: object) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            raise _wrong(self, field, value, f", not {_type_name(value)}")
        return value


BOOL = Bool()
OBJECT = Object()
NAME = Str()
# The sizes every family reads, with the bounds above.
LAYERS = Int(1, MAX_LAYERS)
HIDDEN = Int(1, MAX_HIDDEN)
INTERMEDIATE = Int(1, MAX_INTERMEDIATE)
VOCAB = Int(1, MAX_VOCAB)
HEADS = Int(1, MAX_HEADS)
HEAD_DIM = Int(1, MAX_HEAD_DIM)
EXPERTS = Int(1, MAX_EXPERTS)
WINDOW = Int(1, MAX_CONTEXT)
# RMSNorm epsilon: added to a mean of squares; 0 divides by zero on a zero vector, above 1 is not an epsilon.
EPS = Float(0.0, 1.0, exclusive_min=True)
POSITIVE = Float(0.0, exclusive_min=True)


def require(ok: bool, field: str, value: object, rule: str) -> None:
    """A consistency rule between fields: ``ConfigError(field, value, rule)`` unless ``ok``."""
    if not ok:
        raise ConfigError(field, value, rule)


# A token id: a vocabulary row, or negative counting from the vocabulary's end (PyTorch's padding_idx).
TOKEN_ID = Int(-MAX_VOCAB, MAX_VOCAB)


def padding_idx(f: Fields, vocab: int, default: int | None = None) -> int | None:
    """The embedding row of ``pad_token_id``, which transformers builds as ``nn.Embedding(...,
    padding_idx=pad_token_id)``: a negative id counts from the vocabulary's end (as PyTorch's
    ``padding_idx`` does). None when absent (without a ``default``), null, or outside the vocabulary:
    such an id is never an input, so no embedding row is the pad's."""
    pad: int | None = f.nullable("pad_token_id", TOKEN_ID, default)
    if pad is None:
        return None
    pad = pad + vocab if pad < 0 else pad
    return pad if pad < vocab else None


class Fields:
    """Typed access to one JSON object of the config (``path`` is its dotted name, ``""`` at the top).

    ``get`` treats an absent field and ``null`` alike (transformers' configs write ``null`` for
    "use the default"); ``nullable`` keeps ``null`` as ``None`` where that means "off".
    """

    def __init__(self, data: object, path: str = ""):
        self.data: Mapping[str, Any] = OBJECT.check(path or "config", data)
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def has(self, key: str) -> bool:
        """Whether ``key`` is present and not null."""
        return self.data.get(key) is not None

    def get(self, key: str, spec: Spec, default: Any = REQUIRED) -> Any:
        """The checked value of ``key``; ``default`` when absent or null (an error if required)."""
        value = self.data.get(key)
        if value is None:
            if default is REQUIRED:
                raise ConfigError(self.name(key), value, f"is required: {spec.describe()}")
            return default
        return spec.check(self.name(key), value)

    def nullable(self, key: str, spec: Spec, default: Any) -> Any:
        """Like :meth:`get`, but an explicit ``null`` is ``None`` (e.g. no sliding window)."""
        if key in self.data and self.data[key] is None:
            return None
        return self.get(key, spec, default)

    def first(self, keys: Sequence[str], spec: Spec, default: Any = REQUIRED) -> tuple[str, Any]:
        """``(key, value)`` of the first of ``keys`` present (aliases of one field); else the first key
        with ``default`` (an error naming it if required)."""
        key = next((k for k in keys if self.has(k)), keys[0])
        return key, self.get(key, spec, default)

    def object(self, key: str) -> Fields | None:
        """The nested object ``key`` (None when absent or null); any other JSON type is an error."""
        value = self.get(key, OBJECT, None)
        return None if value is None else Fields(value, self.name(key))
