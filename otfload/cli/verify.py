"""``otfload load --verify``: the loaded model's logits on fixed token ids, finite and, when
transformers can load the checkpoint (a local directory), compared like with like with theirs
(see :mod:`otfload.cli.load`)."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from flax import nnx

TOLERANCE = 1e-3  # float32 logits against float32 logits of the same weights


def verify_ids(vocab_size: int) -> np.ndarray:
    """The fixed token ids ``--verify`` runs: 2 sequences of 16."""
    return np.random.default_rng(0).integers(0, vocab_size, (2, 16))


def model_logits(model: nnx.Module, ids: np.ndarray) -> np.ndarray:
    import jax
    import jax.numpy as jnp

    return np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(ids)), np.float32)


def in_float32(model: nnx.Module) -> None:
    """Cast ``model``'s floating-point parameters to float32 in place (the values are unchanged:
    every float dtype a load casts to widens exactly), so that its forward pass runs in float32."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    state = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(
        lambda x: x.astype(jnp.float32) if isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating) else x,
        state))


def transformers_logits(directory: str, ids: np.ndarray, adapters: list[str] | None = None,
                        rounded_to: np.dtype | None = None) -> np.ndarray:
    """transformers' float32 logits for ``ids`` (the independent reference), with ``adapters``
    applied in order by PEFT (each but the last merged); ``rounded_to``: every weight (adapters
    merged first) rounded to that dtype and back, as the loaded model holds them. Quantized weights
    are decoded to dense float32 when transformers loads them (:func:`dequantized`), so that what is
    rounded is what otfload rounds (compressed layers would decode with their scales rounded too)."""
    import torch
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **dequantized(directory))
    reference = loaded.eval()  # type: ignore[no-untyped-call]  # transformers overrides eval() unannotated
    if adapters:
        from peft import PeftModel

        for i, adapter in enumerate(adapters):
            with warnings.catch_warnings():  # PEFT calls transformers' deprecated names: not the user's to act on
                warnings.simplefilter("ignore", FutureWarning)
                reference = PeftModel.from_pretrained(reference, adapter)
            last = i == len(adapters) - 1 and rounded_to is None  # the last kept apart when nothing is rounded
            reference = reference.eval() if last else reference.merge_and_unload()
    if rounded_to is not None:
        low = {"bfloat16": torch.bfloat16, "float16": torch.float16}[rounded_to.name]
        reference = reference.to(low).to(torch.float32)
    with torch.no_grad():
        logits: np.ndarray = reference(torch.as_tensor(ids)).logits.float().numpy()
    return logits


def dequantized(directory: str) -> dict[str, Any]:
    """``from_pretrained``'s ``quantization_config=`` that decodes the checkpoint's quantized weights
    to dense ones on load, for the quantization methods whose config has ``dequantize``
    (compressed-tensors, FP8, MXFP4, ...); nothing for a plain checkpoint or another method."""
    import json

    from transformers.quantizers.auto import AutoQuantizationConfig

    config = json.loads((Path(directory) / "config.json").read_text()).get("quantization_config")
    if not isinstance(config, dict):
        return {}
    quantization = AutoQuantizationConfig.from_dict(config)
    if not hasattr(quantization, "dequantize"):
        return {}
    quantization.dequantize = True
    return {"quantization_config": quantization}


def max_rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def reference_unavailable(source: str, adapters: list[str] | None = None) -> str | None:
    """Why no transformers comparison can run, or None when it can."""
    if not Path(source).is_dir():
        return "the checkpoint is not a local directory"
    if adapters and not all(Path(a).is_dir() for a in adapters):
        return "an adapter is not a local directory"
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401

        if adapters:
            import peft  # noqa: F401
    except ImportError:
        return "transformers (with torch" + (" and peft" if adapters else "") + ") is not installed"
    return None


def verify(model: nnx.Module, source: str, vocab_size: int, adapters: list[str] | None = None) -> bool:
    """Print the verification of ``model`` (loaded from ``source``); True when it passed."""
    from flax import nnx

    ids = verify_ids(vocab_size)
    logits = model_logits(model, ids)
    finite = bool(np.isfinite(logits).all())
    print(f"verify: logits {logits.shape} {'finite' if finite else 'NOT FINITE'}")
    if not finite:
        return False
    skipped = reference_unavailable(source, adapters)
    if skipped:
        print(f"verify: no comparison with transformers: {skipped}")
        return True
    dtype = np.dtype(nnx.to_flat_state(nnx.state(model, nnx.Param))[0][1].get_value().dtype)
    rounded = None if dtype == np.float32 else dtype
    if rounded is not None:  # like with like: both in float32, from the weights as loaded
        in_float32(model)
        logits = model_logits(model, ids)
    tolerance = TOLERANCE
    print("verify: loading the reference with transformers" + (" and PEFT" if adapters else "") + " ...",
          file=sys.stderr, flush=True)  # the longest step of --verify on a real model
    diff = max_rel_diff(logits, transformers_logits(source, ids, adapters, rounded))
    ok = diff <= tolerance
    compared = "float32 forward passes" if rounded is None else \
        f"float32 forward passes of the weights as loaded in {dtype} (transformers' rounded to {dtype} too)"
    print(f"verify: max relative difference vs transformers {diff:.2e} ({compared}; tolerance {tolerance:.0e}): "
          f"{'ok' if ok else 'FAILED'}")
    return ok
