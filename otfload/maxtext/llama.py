"""MaxText's Llama 3.1 (``decoder_block: llama2``, ``llama3.1-8b/70b/405b``): its Llama 3.1 RoPE
rotates interleaved pairs, so q and k come with each head's halves interleaved, and the query
kernel is pre-scaled by ``float32(1/sqrt(head_dim))`` (MaxText's converter's two hooks; its
attention then applies no ``1/sqrt(head_dim)`` of its own)."""

from __future__ import annotations

from otfload.maxtext.tables import ModelTable, attention, decoder_layers, dense_mlp, layer_norms, top_leaves

LLAMA31 = ModelTable(
    name="llama3.1",
    model_types=frozenset({"llama"}),
    top=top_leaves(),
    groups=decoder_layers(*layer_norms(), *attention(rope_interleaved=True, query_scaled=True), *dense_mlp()),
)
