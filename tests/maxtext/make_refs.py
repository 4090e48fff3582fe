"""Write the tiny HF checkpoints and transformers' reference logits the MaxText tests compare against.

Run by the main venv (it has torch and transformers; the MaxText venv has no torch):
``.venv/bin/python tests/maxtext/make_refs.py DIR``. For each family in ``FAMILIES`` it writes
``DIR/<family>/``: a random float32 checkpoint saved by ``save_pretrained`` in several shard files
(with ``model.safetensors.index.json`` and ``config.json``), ``ids.npy`` (fixed token ids) and
``logits.npy`` (transformers' float32 logits for them). A family with ``mxfp4`` also gets
``DIR/<family>_mxfp4/``: its experts in MXFP4 as GPT-OSS publishes them; ``DIR/<family>/`` then holds
their dequantised values (what MaxText's loader, which reads no MXFP4, is given), and the logits are
those of that dequantised model. A family with ``fp8`` also gets ``DIR/<family>_fp8/``: its
projections in FP8 e4m3 with block scales. A ``multimodal`` family's ``DIR/<family>/`` has transformers' module
names (what MaxText's converter reads), ``DIR/<family>_hub/`` the keys as saved (as the Hub has
them). The sizes are the ones ``tests/maxtext/models.py`` gives MaxText, so MaxText's tree and the
checkpoint describe the same model.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import module_name, randomize_, rename_tensors, token_ids, torch_logits  # noqa: E402
from tests.maxtext.models import FAMILIES, SEQ, Family  # noqa: E402

# multimodal models whose text-only forward is their language model's: transformers 5.24's
# Llama4ForConditionalGeneration.forward fails without images (its output has no ``image_outputs``)
LANGUAGE_MODEL_FORWARD = ("Llama4ForConditionalGeneration",)


def _hf_model(family: Family):
    import transformers

    config_class = getattr(transformers, family.hf_config)
    model_class = getattr(transformers, family.hf_model)
    return model_class(config_class(**family.hf_kwargs()))


def _randomize_buffers(model, family: Family) -> None:
    """Random values for the stored buffers ``randomize_`` skips (DeepSeek-V3's routing bias, Gemma 4's
    ``layer_scalar``)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    for name, buffer in model.named_buffers():
        if name.endswith(family.random_buffers):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)
        elif name.endswith(family.scalar_buffers):
            buffer.copy_(torch.rand(buffer.shape, generator=gen) + 0.5)


def _mxfp4(model, root: Path, family: Family) -> None:
    """Write ``<family>_mxfp4`` and put its dequantised experts into ``model``."""
    import tempfile

    import torch

    from tests.index.quant import layouts

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size="60KB")
        dequantised = layouts.quantize_checkpoint(Path(tmp), root / f"{family.name}_mxfp4",
                                                  layouts.is_gpt_oss_expert, layouts.mxfp4_experts,
                                                  layouts.MXFP4_CONFIG)
    with torch.no_grad():
        for key, value in dequantised.items():
            model.get_parameter(key).copy_(torch.from_numpy(value))


def _module_names(out: Path, hub: Path) -> None:
    """Keep the checkpoint as saved (the Hub's layout) in ``hub``; rename ``out``'s tensors to
    transformers' module names, the keys MaxText's converter reads (``model.language_model.*``; a
    checkpoint saved under them, Qwen3.5's, keeps its keys)."""
    shutil.copytree(out, hub)
    rename_tensors(out, lambda key: key if key.startswith(("model.", "lm_head.")) else module_name(key))


def fused_copy(src: Path, out: Path) -> Path:
    """A copy of the checkpoint at ``src`` in ``out`` with its experts fused (:func:`fuse_experts`)."""
    shutil.copytree(src, out)
    fuse_experts(out)
    return out


def fuse_experts(out: Path) -> None:
    """Each layer's per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight`` of the checkpoint at
    ``out`` as the fused ``mlp.experts.gate_up_proj`` ``[E, 2 * moe_mlp, embed]`` (gate rows, then up)
    and ``mlp.experts.down_proj`` ``[E, embed, moe_mlp]``, in the shard of the layer's first expert."""
    import json
    import re

    from safetensors.numpy import load_file, save_file

    index_file = out / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = {f: load_file(out / f) for f in sorted(set(index["weight_map"].values()))}
    expert = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")
    found: dict[str, dict[tuple[int, str], tuple[str, str]]] = {}
    for f, tensors in shards.items():
        for key in tensors:
            if m := expert.fullmatch(key):
                found.setdefault(m[1], {})[int(m[2]), m[3]] = (f, key)
    for prefix, parts in found.items():
        def stacked(kind: str, parts=parts) -> np.ndarray:
            keys = [parts[e, kind] for e in range(len(parts) // 3)]
            return np.stack([shards[f].pop(k) for f, k in keys])

        home = parts[0, "gate"][0]
        shards[home][f"{prefix}.gate_up_proj"] = np.concatenate([stacked("gate"), stacked("up")], axis=1)
        shards[home][f"{prefix}.down_proj"] = stacked("down")
    for f, tensors in shards.items():
        save_file(tensors, out / f, metadata={"format": "pt"})
    index["weight_map"] = {k: f for f, tensors in shards.items() for k in tensors}
    index_file.write_text(json.dumps(index))


def write(root: Path, family: Family) -> None:
    import torch

    out = root / family.name
    torch.manual_seed(0)
    model = _hf_model(family)
    randomize_(model)
    model = model.float().eval()
    if family.random_buffers or family.scalar_buffers:
        _randomize_buffers(model, family)
    if family.mxfp4:
        _mxfp4(model, root, family)
    model.save_pretrained(out, max_shard_size="60KB")
    if family.fused_experts:
        fuse_experts(out)
    if family.multimodal:
        _module_names(out, root / f"{family.name}_hub")
    if family.fp8:
        from tests.index.quant import layouts

        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
        layouts.quantize_checkpoint(out, root / f"{family.name}_fp8", layouts.is_linear, layouts.fp8_blocks((16, 16)),
                                    config)
    ids = token_ids(batch=2, seq=SEQ, vocab=family.vocab)
    np.save(out / "ids.npy", ids)
    forward = model.language_model if family.hf_model in LANGUAGE_MODEL_FORWARD else model
    np.save(out / "logits.npy", torch_logits(forward, ids))


def main(argv: list[str]) -> None:
    """``make_refs.py DIR [FAMILY ...]``: every family's checkpoint, or those named."""
    root, names = Path(argv[1]), argv[2:]
    for family in FAMILIES.values():
        if family.same_checkpoint_as is None and (not names or family.name in names):
            write(root, family)


if __name__ == "__main__":
    main(sys.argv)
