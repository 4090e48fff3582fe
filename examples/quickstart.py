"""Make a tiny Llama checkpoint locally (no network), load it sharded with otfload, run it.

    .venv/bin/python examples/quickstart.py
"""

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 simulated devices

import jax.numpy as jnp
from transformers import LlamaConfig, LlamaForCausalLM

import otfload

with tempfile.TemporaryDirectory() as checkpoint:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(checkpoint, max_shard_size="100KB")  # a few shard files

    mesh = otfload.make_mesh({"fsdp": 2, "tp": 4})
    model, report = otfload.from_pretrained(checkpoint, mesh=mesh, return_report=True, progress=False)
    logits = model(jnp.ones((1, 8), dtype=jnp.int32))
    print(report.summary(), file=sys.stderr)
    print("logits shape:", logits.shape)
