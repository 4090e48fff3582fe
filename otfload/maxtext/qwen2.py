"""MaxText's Qwen2.5 (``decoder_block: qwen2``, ``qwen2.5-1.5b/7b/14b``): biased q/k/v projections
(``[heads, head_dim]`` biases), HF's rotate-half RoPE order, no query pre-scale and no q/k norms
(MaxText's converter transposes the kernels and splits the biases' heads, nothing else)."""

from __future__ import annotations

from otfload.maxtext.tables import (
    ModelTable,
    attention,
    attention_biases,
    decoder_layers,
    dense_mlp,
    layer_norms,
    top_leaves,
)

QWEN2 = ModelTable(
    name="qwen2",
    model_types=frozenset({"qwen2"}),
    top=top_leaves(),
    groups=decoder_layers(*layer_norms(), *attention(rope_interleaved=False, query_scaled=False), *attention_biases(),
                          *dense_mlp()),
)
