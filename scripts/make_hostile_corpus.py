"""Write the hand-made corpus of hostile safetensors files and ``config.json`` files, and the error each must raise.

Usage (from the repository root): ``.venv/bin/python scripts/make_hostile_corpus.py [OUT_DIR]``
(default ``tests/index/hostile_corpus``). Each file is built byte by byte, deterministically, so the
committed corpus can be checked to be exactly what this script writes. ``expected.json`` maps every
file name to ``{"error": class name or null, "message": substring of the message}``.

``configs/`` holds hostile ``config.json`` files for the tiny test checkpoints (``base``: the
``tests.helpers`` model kind whose tensors they are loaded with); ``configs/expected.json`` adds the
config field the :class:`~otfload.errors.ConfigError` must name (null for errors raised while reading
the JSON itself).
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "index" / "hostile_corpus"
U64_MAX = 2**64 - 1
CAP = 100_000_000  # otfload.index.header.MAX_HEADER_BYTES, repeated so the corpus does not depend on the code


def prefixed(header: bytes, data: bytes = b"", length: int | None = None) -> bytes:
    """``header`` behind its 8-byte little-endian length (or a forged ``length``), then ``data``."""
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def entry(dtype: object = "F32", shape: object = (2,), offsets: object = (0, 8), **extra: object) -> dict:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets), **extra}


def file_of(tensors: dict, data: bytes = b"\0" * 8, metadata: object = None) -> bytes:
    header = ({"__metadata__": metadata} if metadata is not None else {}) | tensors
    return prefixed(json.dumps(header).encode(), data)


def raw(text: str, data: bytes = b"") -> bytes:
    return prefixed(text.encode("utf-8", "surrogatepass"), data)


T = '"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}'  # a valid entry, for raw JSON text

# name: (file bytes, expected error class or None, substring of the message)
CASES: dict[str, tuple[bytes, str | None, str]] = {
    "valid": (file_of({"w": entry()}, metadata={"format": "np"}), None, ""),
    "empty-file": (b"", "CorruptFileError", "empty file (0 bytes)"),
    "seven-bytes": (b"\x10\0\0\0\0\0\0", "TruncatedFileError", "too short"),
    "length-past-end": (prefixed(b"{}", length=1000), "TruncatedFileError", "runs past the end"),
    "length-u64-max": (prefixed(b"{}", length=U64_MAX), "HeaderError", "cap"),
    "length-over-cap": (prefixed(b"{}", length=CAP + 1), "HeaderError", "cap"),
    "length-zero": (prefixed(b"", length=0), "HeaderError", "does not start with '{'"),
    "length-short-by-one": (prefixed(b'{"a":1}', length=6), "HeaderError", "not valid JSON"),
    "not-json": (raw("{not json}"), "HeaderError", "not valid JSON"),
    "truncated-json": (raw('{"w":{"dtype"'), "HeaderError", "not valid JSON"),
    "trailing-garbage": (raw("{" + T + "}}", b"\0"), "HeaderError", "not valid JSON"),
    "non-string-key": (raw('{1:{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"), "HeaderError",
                       "not valid JSON"),
    "invalid-utf8": (prefixed(b'{"w\xff":{}}'), "HeaderError", "not valid UTF-8"),
    "overlong-utf8": (prefixed(b'{"\xc0\xaf":{}}'), "HeaderError", "not valid UTF-8"),
    "encoded-surrogate": (prefixed(b'{"\xed\xa0\x80":{}}'), "HeaderError", "not valid UTF-8"),
    "escaped-lone-surrogate": (raw('{"\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
                               "HeaderError", "not valid UTF-8 text"),
    "byte-order-mark": (raw("\ufeff{" + T + "}", b"\0"), "HeaderError", "does not start with '{'"),
    "leading-space": (raw(" {" + T + "}", b"\0"), "HeaderError", "does not start with '{'"),
    "deep-nesting": (raw('{"__metadata__":' + "[" * 5000 + "]" * 5000 + "}"), "HeaderError", "not valid JSON"),
    "number-too-long": (raw('{"w":{"dtype":"U8","shape":[' + "9" * 5000 + '],"data_offsets":[0,1]}}'),
                        "HeaderError", "not valid JSON"),
    "duplicate-tensor": (raw("{" + T + "," + T + "}", b"\0"), "HeaderError", "duplicate key 'w'"),
    "duplicate-field": (raw('{"w":{"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]}}', b"\0"),
                        "HeaderError", "duplicate key 'dtype'"),
    "unknown-dtype": (file_of({"w": entry("F128")}), "UnknownDtypeError", "unknown dtype 'F128'"),
    "lowercase-dtype": (file_of({"w": entry("f32")}), "UnknownDtypeError", "unknown dtype 'f32'"),
    "numeric-dtype": (file_of({"w": entry(4)}), "UnknownDtypeError", "unknown dtype 4"),
    "complex-dtype": (file_of({"w": entry("C64", (1,))}), "UnknownDtypeError", "unknown dtype 'C64'"),
    "negative-dim": (file_of({"w": entry(shape=(-2,))}), "HeaderError", "64-bit unsigned"),
    "float-dim": (file_of({"w": entry(shape=(2.0,))}), "HeaderError", "64-bit unsigned"),
    "bool-dim": (file_of({"w": entry(shape=(True, 2))}), "HeaderError", "64-bit unsigned"),
    "shape-not-list": (file_of({"w": entry(shape="2")}), "HeaderError", "64-bit unsigned"),
    "dim-over-u64": (file_of({"w": entry(shape=(2**64, 0))}), "HeaderError", "64-bit unsigned"),
    "huge-dims": (file_of({"w": entry(shape=(10**3000,) * 2)}), "HeaderError", "64-bit unsigned"),
    "shape-overflows-u64": (file_of({"w": entry(shape=(2**32, 2**32, 0), offsets=(0, 0))}, b""), "HeaderError",
                            "more than 2**64 elements"),
    "negative-offset": (file_of({"w": entry(offsets=(-8, 0))}), "HeaderError", "data_offsets"),
    "three-offsets": (file_of({"w": entry(offsets=(0, 8, 8))}), "HeaderError", "two 64-bit unsigned ints"),
    "offset-over-u64": (file_of({"w": entry(offsets=(2**64, 2**64 + 8))}), "HeaderError", "64-bit unsigned"),
    "reversed-offsets": (file_of({"w": entry(offsets=(8, 0))}), "HeaderError", "needs 8 bytes"),
    "span-too-small": (file_of({"w": entry(offsets=(0, 4))}, b"\0" * 4), "HeaderError",
                       "needs 8 bytes but data_offsets span 4"),
    "span-too-large": (file_of({"w": entry("BF16")}), "HeaderError", "needs 4 bytes but data_offsets span 8"),
    "overlap": (file_of({"a": entry(), "b": entry(offsets=(4, 12))}, b"\0" * 12), "HeaderError",
                "overlaps the previous tensor"),
    "same-span-twice": (file_of({"a": entry(), "b": entry()}), "HeaderError", "overlaps the previous tensor"),
    "gap": (file_of({"w": entry(offsets=(4, 12))}, b"\0" * 12), "HeaderError", "leaves a gap"),
    "data-past-end": (file_of({"w": entry()}, b"\0" * 7), "TruncatedFileError", "past the end of the 7-byte data"),
    "offsets-far-out-of-file": (file_of({"a": entry(), "w": entry("U8", (1,), (2**40, 2**40 + 1))}),
                                "TruncatedFileError", "tensor 'w': data_offsets [1099511627776, 1099511627777] run"),
    "huge-tensor-tiny-file": (file_of({"w": entry("F32", (2**30, 2**30), (0, 2**62))}), "TruncatedFileError",
                              "past the end"),
    "trailing-bytes": (file_of({"w": entry()}, b"\0" * 9), "HeaderError", "1 trailing bytes"),
    "missing-field": (file_of({"w": {"dtype": "F32", "shape": [2]}}), "HeaderError", "exactly dtype, shape"),
    "extra-field": (file_of({"w": entry(extra="x")}), "HeaderError", "exactly dtype, shape"),
    "entry-not-object": (file_of({"w": [0, 8]}), "HeaderError", "exactly dtype, shape"),
    "metadata-not-object": (file_of({"w": entry()}, metadata=[]), "HeaderError", "__metadata__ must map"),
    "metadata-int-value": (file_of({"w": entry()}, metadata={"n": 1}), "HeaderError", "__metadata__ must map"),
    "metadata-nan": (raw('{"__metadata__":{"n":NaN},' + T + "}", b"\0"), "HeaderError", "__metadata__ must map"),
}


# --- config.json cases ------------------------------------------------------------------------------

# The config.json fields of the tiny checkpoints ``tests.helpers`` builds (``llama``; ``mixtral`` in
# tests/families/test_mixtral.py), written out so the corpus does not depend on transformers.
LLAMA = {
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu", "rms_norm_eps": 1e-06,
    "max_position_embeddings": 128, "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16, "rope_theta": 500000.0},
}
MIXTRAL = {
    **LLAMA, "model_type": "mixtral", "head_dim": None, "num_local_experts": 4, "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-05, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
}
BASES = {"llama": LLAMA, "mixtral": MIXTRAL}
DROP = object()  # a change that removes the field


def config(base: str, **changes: object) -> tuple[str, bytes]:
    """``(base, config.json bytes)``: the base config with top-level ``changes`` (``DROP`` removes)."""
    fields = {**BASES[base], **changes}
    fields = {k: v for k, v in fields.items() if v is not DROP}
    return base, json.dumps(fields, indent=1).encode()


def raw_config(base: str, text: str | bytes) -> tuple[str, bytes]:
    return base, text.encode() if isinstance(text, str) else text


def rope(**changes: object) -> dict:
    return {**LLAMA["rope_parameters"], **changes}


# name: ((base, config.json bytes), error class or None, field named or None, substring of the message)
CONFIG_CASES: dict[str, tuple[tuple[str, bytes], str | None, str | None, str]] = {
    "valid-llama": (config("llama"), None, None, ""),
    "valid-mixtral": (config("mixtral"), None, None, ""),
    "layers-1e9-float": (raw_config("llama", json.dumps(LLAMA).replace('"num_hidden_layers": 3',
                                                                         '"num_hidden_layers": 1e9')),
                         "ConfigError", "num_hidden_layers", "must be an integer in [1, 1024], not a float"),
    "layers-10e6": (config("llama", num_hidden_layers=10**6), "ConfigError", "num_hidden_layers",
                    "must be an integer in [1, 1024]"),
    "layers-negative": (config("llama", num_hidden_layers=-1), "ConfigError", "num_hidden_layers", "[1, 1024]"),
    "layers-bool": (config("llama", num_hidden_layers=True), "ConfigError", "num_hidden_layers", "not a boolean"),
    "layers-float-3.0": (config("llama", num_hidden_layers=3.0), "ConfigError", "num_hidden_layers", "not a float"),
    "layers-vs-tensors": (config("llama", num_hidden_layers=4), "ConfigError", "num_hidden_layers",
                          "the tensors hold 3 layer indices (0-2)"),
    "layers-missing": (config("llama", num_hidden_layers=DROP), "ConfigError", "num_hidden_layers", "is required"),
    "vocab-vs-embed": (config("llama", vocab_size=1000), "ConfigError", "vocab_size",
                       "model.embed_tokens.weight has shape (256, 64)"),
    "tie-string-no": (config("llama", tie_word_embeddings="no"), "ConfigError", "tie_word_embeddings",
                      "must be a JSON boolean"),
    "hidden-act-unknown": (config("llama", hidden_act="relu"), "ConfigError", "hidden_act", "one of 'silu'"),
    "rope-type-unknown": (config("llama", rope_parameters=rope(rope_type="dynamic")), "ConfigError",
                          "rope_parameters.rope_type", "one of 'default', 'linear', 'llama3', 'yarn'"),
    "rope-scaling-legacy-type-unknown": (config("llama", rope_scaling={"type": "longrope", "factor": 4.0}),
                                         "ConfigError", "rope_scaling.type", "one of 'default'"),
    "rope-theta-nan": (raw_config("llama", json.dumps(LLAMA).replace("500000.0", "NaN")), "ConfigError",
                       "rope_parameters.rope_theta", "a finite number"),
    "rope-theta-infinity": (raw_config("llama", json.dumps(LLAMA).replace("500000.0", "Infinity")), "ConfigError",
                            "rope_parameters.rope_theta", "a finite number"),
    "heads-not-dividing-hidden": (config("llama", num_attention_heads=3, num_key_value_heads=1, head_dim=DROP),
                                  "ConfigError", "hidden_size", "divisible by num_attention_heads (3)"),
    "kv-heads-not-dividing-heads": (config("llama", num_key_value_heads=3), "ConfigError", "num_key_value_heads",
                                    "must divide num_attention_heads (4)"),
    "heads-vs-q-proj": (config("llama", num_attention_heads=8), "ConfigError", "num_attention_heads",
                        "num_attention_heads × head_dim (16) = 128"),
    "model-type-int": (config("llama", model_type=3), "ConfigError", "model_type", "a string"),
    "model-type-missing": (config("llama", model_type=DROP), "ConfigError", "model_type", "is required"),
    "experts-vs-tensors": (config("mixtral", num_local_experts=16), "ConfigError", "num_local_experts",
                           "the tensors hold 4 expert indices (0-3)"),
    "experts-10e9": (config("mixtral", num_local_experts=10**9), "ConfigError", "num_local_experts", "[1, 16384]"),
    "top-k-above-experts": (config("mixtral", num_experts_per_tok=5), "ConfigError", "num_experts_per_tok",
                            "at most num_local_experts (4)"),
    "json-array": (raw_config("llama", "[" + json.dumps(LLAMA) + "]"), "CheckpointIndexError", None,
                   "not a JSON object"),
    "json-empty": (raw_config("llama", b""), "CheckpointIndexError", None, "not valid JSON"),
    "json-not-utf8": (raw_config("llama", b'{"model_type": "ll\xffama"}'), "CheckpointIndexError", None,
                      "not valid JSON"),
    "json-duplicate-key": (raw_config("llama", json.dumps(LLAMA)[:-1] + ', "num_hidden_layers": 1000}'),
                           "CheckpointIndexError", None, "duplicate key 'num_hidden_layers'"),
    "json-int-5000-digits": (raw_config("llama", json.dumps(LLAMA).replace('"num_hidden_layers": 3',
                                                                             '"num_hidden_layers": ' + "9" * 5000)),
                             "CheckpointIndexError", None, "not valid JSON"),
    "json-deep-nesting": (raw_config("llama", '{"rope_scaling": ' + "[" * 5000 + "]" * 5000 + "}"),
                          "CheckpointIndexError", None, "not valid JSON"),
}


def write_corpus(out: Path) -> None:
    """Replace ``out`` with one ``<name>.safetensors`` per case and ``expected.json``, and ``out/configs``
    with one ``<name>.json`` per config case and its ``expected.json``."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    expected = {}
    for name, (data, error, message) in CASES.items():
        (out / f"{name}.safetensors").write_bytes(data)
        expected[f"{name}.safetensors"] = {"error": error, "message": message}
    (out / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")
    configs = out / "configs"
    configs.mkdir()
    expected = {}
    for name, ((base, data), error, field, message) in CONFIG_CASES.items():
        (configs / f"{name}.json").write_bytes(data)
        expected[f"{name}.json"] = {"base": base, "error": error, "field": field, "message": message}
    (configs / "expected.json").write_text(json.dumps(expected, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    write_corpus(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
