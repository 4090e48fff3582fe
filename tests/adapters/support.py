"""Tiny PEFT adapters for the adapter tests: made by PEFT itself (``get_peft_model`` +
``save_pretrained``) with random factors, or written by hand for the error cases, and the reference
logits of ``peft.PeftModel`` on the transformers model."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np

from tests.helpers import torch_logits

# Random B factors (PEFT initialises B to zero, which would make every delta vanish): large enough
# that each adapter changes the logits by far more than the parity tolerance.
FACTOR_STD = 0.1
PEFT_PREFIX = "base_model.model."
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(torch_model, out_dir: Path, *, seed: int = 0, dtype: str | None = None,
                 base_model_name_or_path: str | None = None, **lora) -> Path:
    """Save a PEFT LoRA adapter of ``torch_model`` (untouched) with random factors and
    ``modules_to_save`` copies; ``dtype`` casts the saved adapter tensors (e.g. ``"bfloat16"``)."""
    import torch
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(torch_model), LoraConfig(**lora))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * FACTOR_STD)
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir)
    if base_model_name_or_path is not None:
        set_config(out_dir, base_model_name_or_path=base_model_name_or_path)
    return Path(out_dir)


def set_config(adapter_dir: Path, **fields) -> Path:
    """Change fields of an adapter's ``adapter_config.json`` in place."""
    path = Path(adapter_dir) / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return Path(adapter_dir)


def peft_logits(torch_model, adapter_dirs: list[Path], ids: np.ndarray) -> np.ndarray:
    """``PeftModel`` logits with ``adapter_dirs`` applied in order (each earlier one merged, as a
    merged checkpoint would be, the last one live)."""
    from peft import PeftModel

    model = copy.deepcopy(torch_model)
    for adapter in adapter_dirs[:-1]:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model = PeftModel.from_pretrained(model, adapter_dirs[-1]).eval()
    return torch_logits(model, ids)


def write_adapter(out_dir: Path, tensors: dict[str, np.ndarray], **config) -> Path:
    """A hand-written adapter: ``tensors`` (keys without the PEFT prefix) and a LoRA config with
    ``config`` overriding PEFT's defaults."""
    from safetensors.numpy import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    defaults = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "bias": "none", "use_dora": False,
                "fan_in_fan_out": False, "target_modules": ["q_proj"], "base_model_name_or_path": None}
    (out_dir / "adapter_config.json").write_text(json.dumps({**defaults, **config}))
    save_file({PEFT_PREFIX + k: np.ascontiguousarray(v) for k, v in tensors.items()},
              out_dir / "adapter_model.safetensors")
    return out_dir


def lora_pair(module: str, r: int, inp: int, out: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random ``lora_A`` ``[r, in]`` and ``lora_B`` ``[out, r]`` of ``module``."""
    rng = np.random.default_rng(seed)
    return {f"{module}.lora_A.weight": rng.standard_normal((r, inp), np.float32) * FACTOR_STD,
            f"{module}.lora_B.weight": rng.standard_normal((out, r), np.float32) * FACTOR_STD}


GATE_UP, DOWN = "mlp.experts.gate_up_proj", "mlp.experts.down_proj"
# PEFT's own regex semantics: the first matching entry wins; keys match a dotted suffix of the module.
PATTERNS = dict(rank_pattern={"q_proj": 8, r"layers\.1\.self_attn\.v_proj": 2},
                alpha_pattern={"o_proj": 3, r"model\.layers\.2\..*": 32})

# name -> (tiny model kind, LoRA configs of the adapters applied in order, saved dtype)
ADAPTERS: dict[str, tuple[str, list[dict], str | None]] = {
    "llama_patterns": ("llama", [dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS, **PATTERNS)], None),
    "qwen3_rslora_embed_head": ("qwen3", [dict(r=4, lora_alpha=16, use_rslora=True,
                                               target_modules=["q_proj", "v_proj", "embed_tokens"],
                                               modules_to_save=["lm_head"])], None),
    "llama_tied_embed": ("llama_tied", [dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"])], None),
    "qwen3_tied_head": ("qwen3_tied", [dict(r=4, lora_alpha=8, target_modules=["k_proj"],
                                            modules_to_save=["lm_head"])], None),
    "llama_bf16": ("llama", [dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS)], "bfloat16"),
    "llama_two": ("llama", [dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS),
                            dict(r=2, lora_alpha=2, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])],
                  None),
    "qwen3_three": ("qwen3", [dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "gate_proj"]),
                              dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "down_proj"]),
                              dict(r=2, lora_alpha=4, target_modules=["o_proj", "up_proj", "q_proj"])], None),
    "mixtral_fused": ("mixtral", [dict(r=2, lora_alpha=4, target_modules=[], target_parameters=[GATE_UP, DOWN])],
                      None),
    "qwen3_moe_fused": ("qwen3_moe", [dict(r=2, lora_alpha=4, target_modules=["q_proj"],
                                           target_parameters=[GATE_UP, DOWN])], None),
    "gpt_oss_fused": ("gpt_oss", [dict(r=2, lora_alpha=4, target_modules=[], target_parameters=[GATE_UP, DOWN])],
                      None),
}
# Pre-transformers-5 MoE adapters: one LoRA per expert module, as the stored checkpoint names them.
PER_EXPERT = {"mixtral": ".block_sparse_moe.experts.", "qwen3_moe": ".mlp.experts."}


def per_expert_adapter(checkpoint: Path, out_dir: Path, marker: str, r: int = 2, alpha: int = 4) -> Path:
    """A hand-written adapter with a random LoRA on every per-expert weight of ``checkpoint``."""
    from tests.helpers import hf_tensors

    tensors = {}
    experts = sorted((k, v.shape) for k, v in hf_tensors(checkpoint).items() if marker in k)
    for seed, (key, shape) in enumerate(experts):
        tensors.update(lora_pair(key.removesuffix(".weight"), r, shape[1], shape[0], seed=seed))
    targets = sorted({k.rsplit(".", 2)[-2] for k, _ in experts})
    return write_adapter(out_dir, tensors, r=r, lora_alpha=alpha, target_modules=targets)


def merged_peft_logits(torch_model, adapter_dir: Path, ids: np.ndarray) -> np.ndarray:
    """Logits of ``PeftModel.merge_and_unload()`` with ``adapter_dir`` on a copy of ``torch_model``:
    the reference for modules PEFT merges but cannot run unmerged (DeepSeek-V4's grouped ``o_a_proj``)."""
    from peft import PeftModel

    return torch_logits(PeftModel.from_pretrained(copy.deepcopy(torch_model), adapter_dir).merge_and_unload(), ids)


def kept_factors(model) -> list:
    """The :class:`~otfload.adapters.weight.LoraWeight` leaves of ``model``: its adapter kept as factors."""
    import jax
    from flax import nnx

    from otfload.adapters.weight import LoraWeight

    leaves = jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=lambda x: isinstance(x, LoraWeight))
    return [w for w in leaves if isinstance(w, LoraWeight)]
