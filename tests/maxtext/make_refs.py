"""Write the tiny HF checkpoints and transformers' reference logits the MaxText tests compare against.

Run by the main venv (it has torch and transformers; the MaxText venv has no torch):
``.venv/bin/python tests/maxtext/make_refs.py DIR``. For each family in ``FAMILIES`` it writes
``DIR/<family>/``: a random float32 checkpoint saved by ``save_pretrained`` in several shard files
(with ``model.safetensors.index.json`` and ``config.json``), ``ids.npy`` (fixed token ids) and
``logits.npy`` (transformers' float32 logits for them). The sizes are the ones ``tests/maxtext/models.py``
gives MaxText, so MaxText's tree and the checkpoint describe the same model.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import randomize_, token_ids, torch_logits  # noqa: E402
from tests.maxtext.models import FAMILIES, SEQ, Family  # noqa: E402


def _hf_model(family: Family):
    import transformers

    config_class = getattr(transformers, family.hf_config)
    model_class = getattr(transformers, family.hf_model)
    return model_class(config_class(**family.hf_kwargs()))


def write(root: Path, family: Family) -> None:
    import torch

    out = root / family.name
    torch.manual_seed(0)
    model = _hf_model(family)
    randomize_(model)
    model = model.float().eval()
    model.save_pretrained(out, max_shard_size="60KB")
    ids = token_ids(batch=2, seq=SEQ, vocab=family.vocab)
    np.save(out / "ids.npy", ids)
    np.save(out / "logits.npy", torch_logits(model, ids))


def main(argv: list[str]) -> None:
    root = Path(argv[1])
    for family in FAMILIES.values():
        if family.same_checkpoint_as is None:
            write(root, family)


if __name__ == "__main__":
    main(sys.argv)
