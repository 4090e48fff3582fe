"""``export_adapter``: write a model's separate LoRA factors back as a PEFT adapter.

For every adapted leaf of a model loaded with ``merge_adapter=False`` (its record in
:mod:`otfload.adapters.factored`), the factors are gathered to the host and each stacked slice is
turned back into PEFT's layout by inverting the load's gathers exactly: ``A[:, a_index] = a`` gives
``lora_A`` ``[r, in]``, ``B[b_index] = b`` gives ``lora_B`` ``[out, r]`` (zero padding beyond a
slice's own rank dropped). Keys are ``base_model.model.<module>.lora_A.weight`` with the module
names the loaded adapter used. ``adapter_config.json`` carries the loaded adapter's ``r``,
``lora_alpha``, ``use_rslora`` and rank/alpha patterns, and lists the adapted modules by their full
names in ``target_modules``, so PEFT resolves every module's rank and scale as before.

Factors that span several processes are gathered with a collective (every process must call);
process 0 writes. The directory appears atomically (a temporary directory renamed into place).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from otfload.adapters.config import CONFIG_FILE, WEIGHTS_FILE, AdapterConfig
from otfload.adapters.factored import factored_record
from otfload.adapters.merge import PEFT_PREFIX
from otfload.adapters.weight import LoraWeight
from otfload.atomic import atomic_dir
from otfload.errors import AdapterError
from otfload.index.dtypes import to_numpy_dtype
from otfload.plan.abstract import dotted


def host_array(array: jax.Array) -> np.ndarray:
    """The whole of ``array`` on the host (a collective when other processes hold parts of it)."""
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(jax.device_get(array))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def adapter_config_json(config: AdapterConfig | None, modules: list[str]) -> dict[str, Any]:
    """A PEFT LoRA ``adapter_config.json`` for ``modules``, with the loaded adapter's rank fields."""
    assert config is not None
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": config.r,
        "lora_alpha": config.lora_alpha,
        "use_rslora": config.use_rslora,
        "rank_pattern": dict(config.rank_pattern),
        "alpha_pattern": dict(config.alpha_pattern),
        "target_modules": sorted(set(modules)),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "base_model_name_or_path": config.base_model_name_or_path,
        "revision": config.revision,
    }


def adapter_tensors(model: nnx.Module, dtype: Any = None) -> tuple[dict[str, np.ndarray], list[str]]:
    """``({PEFT key: tensor}, adapted modules)`` of a factored model's current factors."""
    record = factored_record(model)
    if not record.leaves:
        raise AdapterError("the model has no LoRA factors to export (it was loaded with merge_adapter=False and no "
                           "adapter, or its adapter was removed); load one with otfload.load_adapter")
    values = {dotted(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    tensors, modules = {}, []
    for path, leaf in record.leaves.items():
        weight = values.get(path)
        if not isinstance(weight, LoraWeight):
            raise AdapterError(f"leaf {path!r} no longer holds a LoraWeight (its factors were replaced by "
                               f"{type(weight).__name__}); nothing to export for it")
        a, b = host_array(weight.a), host_array(weight.b)
        out_dtype = a.dtype if dtype is None else to_numpy_dtype(dtype)
        for i, term in enumerate(leaf.terms):
            if term is None:
                continue
            at = np.unravel_index(i, leaf.stack_shape) if leaf.stack_shape else ()
            a_k, b_k = a[at][: term.rank], b[at][..., : term.rank]
            if np.any(a[at][term.rank :]) or np.any(b[at][..., term.rank :]):
                raise AdapterError(f"leaf {path!r}: module {term.module!r} has rank {term.rank}, but its factors "
                                   f"beyond that rank (zero padding up to the leaf's rank {leaf.rank}) are no longer "
                                   "zero; an update changed them, so the adapter cannot be written at its rank")
            lora_a = np.empty((term.rank, leaf.a_index.size), a.dtype)
            lora_a[:, leaf.a_index.ravel()] = a_k.reshape(term.rank, -1)
            lora_b = np.empty((leaf.b_index.size, term.rank), b.dtype)
            lora_b[leaf.b_index.ravel()] = b_k.reshape(-1, term.rank)
            tensors[f"{PEFT_PREFIX}{term.module}.lora_A.weight"] = lora_a.astype(out_dtype)
            tensors[f"{PEFT_PREFIX}{term.module}.lora_B.weight"] = lora_b.astype(out_dtype)
            modules.append(term.module)
    return tensors, modules


def export_adapter(model: nnx.Module, out_dir: str | os.PathLike[str], *, dtype: Any = None,
                   overwrite: bool = False) -> Path:
    """Write the separate LoRA adapter of ``model`` (loaded with ``merge_adapter=False``, maybe trained
    since) to ``out_dir`` as a PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base, out_dir)`` loads; returns the path. ``dtype``
    (``None``: the factors' float32) casts the factors. The write is atomic; an existing ``out_dir``
    is replaced only with ``overwrite=True``. In a multi-process job every process calls it and
    process 0 writes."""
    record = factored_record(model)
    tensors, modules = adapter_tensors(model, dtype)
    target = Path(out_dir)
    if jax.process_index() != 0:
        return target
    with atomic_dir(target, overwrite) as tmp:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp / WEIGHTS_FILE))
        config = adapter_config_json(record.adapter, modules)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return target


__all__ = ["adapter_config_json", "adapter_tensors", "export_adapter"]
