"""``otfload example DIR`` / ``python -m otfload.examples DIR`` (issue 44 point 9): the checkpoints
the docs pages read, checked against independent readers: the tiny Llama's logits against
transformers', its tokenizer and chat template as transformers reads them, the FP8 copy's weights
against the float32 ones they quantize (e4m3: 3 mantissa bits), the adapter as PEFT reads it."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
import warnings

import ml_dtypes
import numpy as np
import pytest

import otfload
from otfload.errors import OutputExistsError
from otfload.examples import write_examples
from tests.helpers import jax_logits, max_rel_diff, token_ids, torch_logits


def test_the_tiny_llama_is_a_llama_transformers_runs_with_its_tokenizer(example_checkpoints):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = example_checkpoints.llama
    assert len(list(path.glob("model-*.safetensors"))) > 1  # several shard files, as published checkpoints
    ids = token_ids()
    theirs = torch_logits(AutoModelForCausalLM.from_pretrained(path).eval(), ids)
    assert max_rel_diff(jax_logits(otfload.from_pretrained(path), ids), theirs) < 1e-4
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer("the quick brown fox")["input_ids"][0] == tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_id == 2
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        "<|user|>hi\n<|assistant|>"


def test_the_fp8_copy_quantizes_the_llama(example_checkpoints):
    from flax import nnx

    config = json.loads((example_checkpoints.quantized / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    leaves = {}
    for name, checkpoint in (("f32", example_checkpoints.llama), ("fp8", example_checkpoints.quantized)):
        model = otfload.from_pretrained(checkpoint, dtype="float32")
        leaves[name] = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    quantized = 0
    for path, weight in leaves["f32"].items():  # the float32 Llama's leaves: transformers' (test above)
        ours = leaves["fp8"][path]
        # e4m3 rounds to 3 mantissa bits (relative 2^-4), subnormals to steps of 2^-9 of a scale
        # (the largest value of a row / 448)
        step = np.abs(weight).max() / float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max) * 2.0**-9
        assert np.all(np.abs(ours - weight) <= np.abs(weight) * 2.0**-4 + step), path
        quantized += not np.array_equal(ours, weight)
    assert quantized == 7  # the stacked q, k, v, o, gate, up and down kernels; embeddings, norms, lm_head as stored
    kept = otfload.from_pretrained(example_checkpoints.quantized, scan_layers=False, quantized="keep")
    assert type(kept.layers[1].attn.q.kernel[...]).__name__ == "QuantizedArray"


def test_the_adapter_is_a_peft_lora_of_the_llama(example_checkpoints):
    from peft import PeftConfig

    config = PeftConfig.from_pretrained(example_checkpoints.adapter)
    assert config.base_model_name_or_path == str(example_checkpoints.llama)
    assert (config.peft_type, config.r, sorted(config.target_modules)) == ("LORA", 4, ["q_proj", "v_proj"])


def run_examples_module(*argv: str) -> int:
    """``python -m otfload.examples ARGV`` in this process (its ``__main__`` block; a fresh interpreter
    would cost seconds of imports): the exit code."""
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        patch.setattr(sys, "argv", ["-m", *argv])
        warnings.filterwarnings("ignore", "'otfload.examples' found in sys.modules", RuntimeWarning)  # imported here
        try:
            runpy.run_module("otfload.examples", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            return e.code if isinstance(e.code, int) else 1
    raise AssertionError("python -m otfload.examples returned without sys.exit")


def test_the_command_prints_the_pages_variables_and_refuses_to_overwrite(tmp_path, capsys):
    code = run_examples_module(str(tmp_path / "ex"))
    done = capsys.readouterr()
    assert code == 0, done.err
    shell = subprocess.run(["bash", "-c", f'eval "{done.out}"; echo "$OTFLOAD_EXAMPLE_CKPT $OTFLOAD_EXAMPLE_ADAPTER '
                                          '$OTFLOAD_EXAMPLE_QUANTIZED"'], capture_output=True, text=True)
    assert shell.stdout.split() == [str(tmp_path / "ex" / name) for name in ("tiny-llama", "tiny-lora", "tiny-fp8")]
    with pytest.raises(OutputExistsError):
        write_examples(tmp_path / "ex")
    assert write_examples(tmp_path / "ex", overwrite=True).llama == tmp_path / "ex" / "tiny-llama"
