"""The tiny model of every family (registered by the family test modules) and transformers-side
references for padded batches and greedy generation."""

from __future__ import annotations

import numpy as np

import tests.families.test_deepseek  # noqa: F401  (registers the tiny models of each family)
import tests.families.test_gemma  # noqa: F401
import tests.families.test_gpt_oss  # noqa: F401
import tests.families.test_mixtral  # noqa: F401
import tests.families.test_qwen3_moe  # noqa: F401

# One tiny model per model type: dense (Llama, Mistral's window, Qwen2 biases, Qwen3 q/k norm), MoE
# (Mixtral, Qwen3-MoE's mixed layers, GPT-OSS's sinks and alternating windows), Gemma 2 (soft-caps)
# and 3 (per-type RoPE), DeepSeek V2/V3 (MLA, group routing, shared experts).
KINDS = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "gpt_oss", "gemma2", "gemma3_text",
         "deepseek_v2", "deepseek_v3"]
VOCAB = 256
# Real tokens per row of the padded test batch (the rest of the 12 slots are padding).
REAL = (12, 8, 5)
SEQ = 12


def padded_batch(side: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(ids, mask, base)``: row ``r`` holds the first ``REAL[r]`` tokens of ``base`` padded on
    ``side`` ("left"/"right") with id 0 to ``SEQ`` slots; ``mask`` is 1 on real tokens."""
    base = np.random.default_rng(seed).integers(3, VOCAB, SEQ)
    ids = np.zeros((len(REAL), SEQ), np.int64)
    mask = np.zeros((len(REAL), SEQ), np.int64)
    for r, n in enumerate(REAL):
        cols = slice(SEQ - n, SEQ) if side == "left" else slice(0, n)
        ids[r, cols], mask[r, cols] = base[:n], 1
    return ids, mask, base


def torch_masked_logits(model, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """transformers' ``model(ids, attention_mask=mask[, position_ids=positions]).logits`` in float32."""
    import torch

    kw = {} if positions is None else {"position_ids": torch.tensor(positions)}
    with torch.no_grad():
        return model(torch.tensor(ids), attention_mask=torch.tensor(mask), **kw).logits.float().numpy()


def torch_greedy(model, ids: np.ndarray, mask: np.ndarray, new: int, **kw) -> np.ndarray:
    """transformers' greedy ``generate`` of ``new`` tokens, padded with the pad id to ``s + new``
    columns where every row stopped early (transformers then returns fewer)."""
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=new,
                             do_sample=False, **kw).numpy()
    pad = kw.get("pad_token_id", model.generation_config.pad_token_id)
    if pad is None:
        eos = model.generation_config.eos_token_id
        pad = eos[0] if isinstance(eos, list) else eos
    return np.pad(out, ((0, 0), (0, ids.shape[1] + new - out.shape[1])), constant_values=pad or 0)
