"""otfload as a model of EleutherAI's lm-evaluation-harness (``lm_eval``): the ``otfload`` backend.

    import otfload.lm_eval                      # registers the model name "otfload" with lm_eval
    results = lm_eval.simple_evaluate(model="otfload", model_args="pretrained=org/name", tasks=["arc_easy"])

``OtfloadLM`` (:mod:`otfload.lm_eval.backend`) answers lm_eval's three request types as its ``hf``
backend does, scored by a model :func:`~otfload.from_pretrained` loads; ``python -m
otfload.lm_eval run --model otfload ...`` is lm_eval's own command line with the backend
registered, and ``otfload lm-eval`` a one-command job. Needs the ``lm-eval`` extra
(``pip install "otfload[lm-eval]"``).
"""

from __future__ import annotations

from otfload.lm_eval.backend import OtfloadLM

__all__ = ["OtfloadLM"]
