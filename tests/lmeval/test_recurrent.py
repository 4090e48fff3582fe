"""Models with a recurrent layer are scored one request a row by the lm_eval backend.

A Gated DeltaNet (Qwen3.5, Qwen3-Next), Kimi Delta Attention (Kimi-Linear) or Mamba-2 (Nemotron-H)
layer's state and convolution window (DeepSeek-V4's compressor windows) run along the whole row
whatever the masks say, so the
continuations of one context packed after it (and the groups packed next to each other) would read
one another. Their ``packs_sequences`` is False:
the backend's loglikelihoods of several requests sharing contexts, one of them cut to
``max_length``, equal transformers' log-likelihood of each request scored alone. A dense Llama
still packs, with the same numbers.
"""

from __future__ import annotations

import pytest

pytest.importorskip("lm_eval")

import tests.families.test_deepseek_v4  # noqa: E402,F401  (registers the tiny DeepSeek-V4)
import tests.families.test_kimi_linear  # noqa: E402,F401  (registers the tiny Kimi-Linear)
import tests.families.test_nemotron_h  # noqa: E402,F401  (registers the tiny Nemotron-H)
import tests.families.test_qwen3_5  # noqa: E402,F401  (registers the tiny Qwen3.5)
from tests.eval_support import with_tokenizer  # noqa: E402
from tests.lmeval.tasks import tokenizer_config  # noqa: E402

MAX_LENGTH = 24
REL = 1e-4
# Two contexts with three and two continuations, and one request longer than MAX_LENGTH + 1 (cut).
REQUESTS = [
    ([5, 17, 42, 9, 88, 3, 61], [7, 19]),
    ([5, 17, 42, 9, 88, 3, 61], [120, 4, 33]),
    ([5, 17, 42, 9, 88, 3, 61], [250]),
    ([11, 200, 74, 8], [90, 91, 92, 93]),
    ([11, 200, 74, 8], [6, 45]),
    (list(range(30, 52)), [140, 141, 142, 143, 144]),
]


def reference(torch_model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """transformers' log-likelihood of ``continuation`` after ``context``, the request alone (cut on
    the left to MAX_LENGTH input ids as lm_eval's hf backend cuts it), and whether it is greedy."""
    import torch

    seq = [*context, *continuation][-(MAX_LENGTH + 1):]
    with torch.no_grad():
        logits = torch_model(torch.tensor([seq[:-1]])).logits[0].double()
    picked = logits[-len(continuation):]
    logp = torch.log_softmax(picked, -1)[torch.arange(len(continuation)), torch.tensor(continuation)]
    return float(logp.sum()), bool((picked.argmax(-1) == torch.tensor(continuation)).all())


# Qwen3-Next is not scored here: its model is Qwen3.5's class (otfload.models.hybrid_decoder's
# HybridForCausalLM, the same Gated DeltaNet layers and packs_sequences), scored as qwen3_5.
@pytest.mark.parametrize(("kind", "packs"), [("qwen3_5", False), ("kimi_linear", False), ("nemotron_h", False),
                                            ("deepseek_v4", False), ("llama", True)])
def test_loglikelihoods_equal_each_request_scored_alone(tiny_checkpoints, tmp_path, kind, packs):
    from otfload.lm_eval import OtfloadLM
    from otfload.lm_eval.scoring import make_groups

    path, torch_model = tiny_checkpoints(kind)
    checkpoint = with_tokenizer(path, tmp_path / kind)
    tokenizer_config(checkpoint)
    lm = OtfloadLM(str(checkpoint), mesh="fsdp:2/tp:4", batch_size=4, max_length=MAX_LENGTH)
    assert lm.scorer.packs is packs
    groups = make_groups(REQUESTS, MAX_LENGTH, packs=packs)
    assert max(len(g.requests) for g in groups) == (3 if packs else 1)  # a dense model still packs choices
    ours = lm._loglikelihood_tokens([(None, c, x) for c, x in REQUESTS], disable_tqdm=True)
    for (context, continuation), (logp, greedy) in zip(REQUESTS, ours, strict=True):
        ref, ref_greedy = reference(torch_model, context, continuation)
        assert abs(logp - ref) <= REL * abs(ref), (kind, context, continuation, logp, ref)
        assert greedy == ref_greedy
    assert len({round(logp, 3) for logp, _ in ours}) == len(REQUESTS)  # distinct numbers: not vacuous


def test_a_packing_scorer_refuses_a_model_that_packs_no_sequences(tiny_checkpoints, tmp_path):
    """Packing forced on a recurrent model is a typed error, not silently wrong numbers."""
    from otfload import from_pretrained
    from otfload.errors import UnsupportedModelError
    from otfload.lm_eval.scoring import Scorer, Timings, make_groups

    path, _ = tiny_checkpoints("qwen3_5")
    model = from_pretrained(str(path))
    with pytest.raises(UnsupportedModelError, match="packs no sequences"):
        Scorer(2, MAX_LENGTH, None, None, Timings()).score(make_groups(REQUESTS, MAX_LENGTH), lambda: model)
    with pytest.raises(ValueError, match="packs=False"):
        Scorer(2, MAX_LENGTH, None, None, Timings(), packs=False).plan(make_groups(REQUESTS, MAX_LENGTH))
