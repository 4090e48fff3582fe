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


def _hf_model(family: Family):
    import transformers

    config_class = getattr(transformers, family.hf_config)
    model_class = getattr(transformers, family.hf_model)
    return model_class(config_class(**family.hf_kwargs()))


def _randomize_buffers(model, family: Family) -> None:
    """Random values for the stored buffers ``randomize_`` skips (DeepSeek-V3's routing bias)."""
    import torch

    gen = torch.Generator().manual_seed(1)
    for name, buffer in model.named_buffers():
        if name.endswith(family.random_buffers):
            buffer.copy_(torch.randn(buffer.shape, generator=gen) * 0.1)


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
    transformers' module names, the keys MaxText's converter reads (``model.language_model.*``)."""
    shutil.copytree(out, hub)
    rename_tensors(out, module_name)


def write(root: Path, family: Family) -> None:
    import torch

    out = root / family.name
    torch.manual_seed(0)
    model = _hf_model(family)
    randomize_(model)
    model = model.float().eval()
    if family.random_buffers:
        _randomize_buffers(model, family)
    if family.mxfp4:
        _mxfp4(model, root, family)
    model.save_pretrained(out, max_shard_size="60KB")
    if family.multimodal:
        _module_names(out, root / f"{family.name}_hub")
    if family.fp8:
        from tests.index.quant import layouts

        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
        layouts.quantize_checkpoint(out, root / f"{family.name}_fp8", layouts.is_linear, layouts.fp8_blocks((16, 16)),
                                    config)
    ids = token_ids(batch=2, seq=SEQ, vocab=family.vocab)
    np.save(out / "ids.npy", ids)
    np.save(out / "logits.npy", torch_logits(model, ids))


def main(argv: list[str]) -> None:
    """``make_refs.py DIR [FAMILY ...]``: every family's checkpoint, or those named."""
    root, names = Path(argv[1]), argv[2:]
    for family in FAMILIES.values():
        if family.same_checkpoint_as is None and (not names or family.name in names):
            write(root, family)


if __name__ == "__main__":
    main(sys.argv)
