"""The example checkpoints the docs pages use: ``otfload example DIR`` (or ``python -m otfload.examples DIR``).

Written from numpy and the ``tokenizers`` library alone (no download, no torch), into ``DIR``:

- ``tiny-llama/``: a random Llama 3 (hidden size 64, 3 layers, 4 query and 2 key/value heads, a
  256-token vocabulary), float32, in several shard files with their index, a trained BPE
  ``tokenizer.json`` (its post-processor adds the BOS token), ``tokenizer_config.json`` (BOS and
  EOS tokens), a ``chat_template.jinja`` and ``generation_config.json``;
- ``tiny-lora/``: a PEFT LoRA adapter of it (rank 4 on ``q_proj`` and ``v_proj``, random factors,
  ``base_model_name_or_path`` the absolute path of ``tiny-llama``);
- ``tiny-fp8/``: ``tiny-llama`` with every linear layer but ``lm_head`` in compressed-tensors FP8
  (``float-quantized``: e4m3 codes, one float32 scale per output channel), with its tokenizer files.

Each directory appears whole or not at all (:mod:`otfload.atomic`). The command prints the
``export OTFLOAD_EXAMPLE_*=...`` lines the pages read, so ``eval "$(otfload example DIR)"`` sets them.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from otfload.atomic import atomic_dir
from otfload.errors import OtfloadError, OutputExistsError

if TYPE_CHECKING:
    import numpy as np
# numpy, ml_dtypes and the export writer are imported where used: the command line imports this
# module for its arguments, and its --help must stay fast.

CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu",
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": None, "dtype": "float32",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
}
# The tokenizer's training texts; its vocabulary stays below the model's 256 embedding rows.
CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a checkpoint is loaded on the fly into sharded arrays",
    "evaluation jobs pull the weights straight from the hub",
    "every process reads only the bytes its devices need",
    "the model predicts each token from the tokens before it",
    "perplexity is the exponential of the mean negative log likelihood",
]
SPECIAL = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: the config's BOS and EOS ids
VOCAB_SIZE = 200
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
LORA_RANK, LORA_ALPHA, LORA_TARGETS = 4, 8, ("q_proj", "v_proj")
WEIGHT_STD = 0.1  # norms and factors too, so that no mapping or merge error hides behind ones and zeros
SHARD_BYTES = 60_000  # several shard files, as published checkpoints have
FP8_MAX = 448.0  # the largest float8_e4m3fn
FP8_CONFIG = {
    "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True}}},
    "ignore": ["lm_head"],
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# The variables the docs pages read, in the order of :class:`Examples`' fields.
VARIABLES = ("OTFLOAD_EXAMPLE_CKPT", "OTFLOAD_EXAMPLE_ADAPTER", "OTFLOAD_EXAMPLE_QUANTIZED")


@dataclass(frozen=True)
class Examples:
    """Where :func:`write_examples` put each checkpoint."""

    llama: Path
    adapter: Path
    quantized: Path

    def exports(self) -> str:
        """The shell lines that point the docs pages' variables at these checkpoints."""
        paths = (self.llama, self.adapter, self.quantized)
        lines = [f"export {name}={shlex.quote(str(path))}" for name, path in zip(VARIABLES, paths, strict=True)]
        return "\n".join(["# otfload's example checkpoints (eval this output to use them)", *lines])


def llama_shapes(config: Mapping[str, Any] = CONFIG) -> dict[str, tuple[int, ...]]:
    """HF key → shape of every tensor of the Llama ``config`` describes."""
    hidden, inner, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q, kv = config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "self_attn.q_proj.weight": (q, hidden), "self_attn.k_proj.weight": (kv, hidden),
             "self_attn.v_proj.weight": (kv, hidden), "self_attn.o_proj.weight": (hidden, q),
             "mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
             "mlp.down_proj.weight": (hidden, inner)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes | {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}


def random_tensors(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return {key: (rng.standard_normal(shape) * WEIGHT_STD).astype(np.float32) for key, shape in shapes.items()}


def write_file(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """``tensors`` as one safetensors file."""
    from otfload.export.writer import TensorSpec, write_safetensors

    write_safetensors(path, [TensorSpec(k, v.shape, v.dtype) for k, v in tensors.items()], tensors.__getitem__)


def write_tensors(out: Path, tensors: Mapping[str, np.ndarray], max_shard_bytes: int) -> None:
    """``tensors`` as safetensors shard files of at most ``max_shard_bytes`` in ``out``, with their index."""
    from otfload.export.writer import TensorSpec, plan_shards, write_index

    files = plan_shards([TensorSpec(k, v.shape, v.dtype) for k, v in tensors.items()], max_shard_bytes)
    for name, shard in files.items():
        write_file(out / name, {spec.key: tensors[spec.key] for spec in shard})
    write_index(out, files)


def write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def build_tokenizer(path: Path) -> Path:
    """Train the tiny BPE tokenizer (Metaspace pre-tokenizer and decoder, as SentencePiece-style
    checkpoints ship them; a BOS token added to every text) and save it as ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL, show_progress=False)
    tokenizer.train_from_iterator(CORPUS, trainer)
    bos = tokenizer.token_to_id(SPECIAL[1])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                             special_tokens=[("<s>", bos)])
    path.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path))
    return path


def write_tokenizer_files(out: Path) -> None:
    build_tokenizer(out / "tokenizer.json")
    write_json(out / "tokenizer_config.json", {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[1],
                                               "eos_token": SPECIAL[2], "unk_token": SPECIAL[0]})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    write_json(out / "generation_config.json", {"bos_token_id": CONFIG["bos_token_id"],
                                                "eos_token_id": CONFIG["eos_token_id"]})


def fp8_channel(weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(codes, scale)`` of compressed-tensors' FP8 channel strategy: ``weight ≈ codes * scale``
    with one scale per row (output channel), ``[rows, 1]``, so that each row's largest value is e4m3's."""
    import ml_dtypes
    import numpy as np

    scale = (np.abs(weight).max(axis=1, keepdims=True) / FP8_MAX).astype(np.float32)
    return (weight / scale).astype(ml_dtypes.float8_e4m3fn), scale


def lora_tensors(config: Mapping[str, Any], seed: int) -> dict[str, np.ndarray]:
    """PEFT's keys and shapes of a rank :data:`LORA_RANK` LoRA of :data:`LORA_TARGETS` on the Llama
    of ``config``: ``lora_A [r, in]`` and ``lora_B [out, r]`` per targeted projection, both random
    (PEFT starts ``B`` at zero)."""
    shapes = llama_shapes(config)
    factors: dict[str, tuple[int, ...]] = {}
    for key, (rows, cols) in ((k, s) for k, s in shapes.items() if k.split(".")[-2] in LORA_TARGETS):
        module = f"base_model.model.{key.removesuffix('.weight')}"
        factors[f"{module}.lora_A.weight"] = (LORA_RANK, cols)
        factors[f"{module}.lora_B.weight"] = (rows, LORA_RANK)
    return random_tensors(factors, seed)


def write_examples(directory: str | os.PathLike[str], overwrite: bool = False) -> Examples:
    """Write the three example checkpoints into ``directory`` (made if missing); an existing one is
    an ``OutputExistsError`` unless ``overwrite``."""
    root = Path(directory).absolute()
    root.mkdir(parents=True, exist_ok=True)
    examples = Examples(root / "tiny-llama", root / "tiny-lora", root / "tiny-fp8")
    for path in (examples.llama, examples.adapter, examples.quantized):  # all three checked before any is written
        if path.exists() and not overwrite:
            raise OutputExistsError(f"{path} exists; pass --overwrite (overwrite=True in Python) to replace it")
    weights = random_tensors(llama_shapes(), seed=0)
    with atomic_dir(examples.llama, overwrite) as out:
        write_tensors(out, weights, SHARD_BYTES)
        write_json(out / "config.json", CONFIG)
        write_tokenizer_files(out)
    with atomic_dir(examples.adapter, overwrite) as out:
        write_file(out / "adapter_model.safetensors", lora_tensors(CONFIG, seed=1))
        write_json(out / "adapter_config.json", {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(examples.llama),
            "bias": "none", "fan_in_fan_out": False, "lora_dropout": 0.0, "inference_mode": True, "r": LORA_RANK,
            "lora_alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS)})
    with atomic_dir(examples.quantized, overwrite) as out:
        stored: dict[str, np.ndarray] = {}
        for key, value in weights.items():
            if key.endswith("proj.weight"):
                stored[key], stored[key.removesuffix("weight") + "weight_scale"] = fp8_channel(value)
            else:
                stored[key] = value
        write_tensors(out, stored, SHARD_BYTES)
        write_json(out / "config.json", {**CONFIG, "quantization_config": FP8_CONFIG})
        for name in TOKENIZER_FILES:
            (out / name).write_bytes((examples.llama / name).read_bytes())
    return examples


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``DIR`` and ``--overwrite``: the arguments of ``otfload example`` and ``python -m otfload.examples``."""
    parser.add_argument("directory", metavar="DIR",
                        help="where to write tiny-llama, tiny-lora and tiny-fp8 (made if missing)")
    parser.add_argument("--overwrite", action="store_true", help="replace the example checkpoints if they exist")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m otfload.examples DIR``: what ``otfload example DIR`` does (an error is one line, exit 1)."""
    parser = argparse.ArgumentParser(prog="python -m otfload.examples", description="Write the docs' example "
                                     "checkpoints and print the lines that point OTFLOAD_EXAMPLE_* at them.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        print(write_examples(args.directory, overwrite=args.overwrite).exports())
    except OtfloadError as e:
        print(f"otfload: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
