"""``python -m otfload.lm_eval ARGS``: lm_eval's own command line (``run``, ``ls``, ``validate``)
with the ``otfload`` model registered, so ``run --model otfload --model_args pretrained=...`` works."""

from __future__ import annotations

from lm_eval.__main__ import cli_evaluate

import otfload.lm_eval  # noqa: F401  (registers the "otfload" model)

cli_evaluate()
