"""Fine-tune a checkpoint as loaded: the train step compiles while the weights load, AdamW steps on
a mesh, a native checkpoint of the parameters and the optimizer state (``scan_layers`` recorded),
a restore, and the trained weights written back as a Hugging Face checkpoint.

    .venv/bin/python examples/train.py CHECKPOINT OUT [--steps 3] [--mesh fsdp=2,tp=4] [--unscanned]

``CHECKPOINT`` is anything ``otfload.from_pretrained`` loads (a directory, ``org/name``, a URL);
without one, a tiny random Llama is written to ``OUT/base`` first. The batch is one fixed row of
random token ids (bring your own data loader).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 simulated devices

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import otfload
from otfload.checkpoint import CheckpointConfig, LayoutMetadata, create_manager, resolve_checkpoint_scan_layers
from otfload.models.origin import origin_of
from otfload.training import abstract_model, abstract_optimizer, load_while_compiling, place_like, shardings_of

LEARNING_RATE = 1e-3


def next_token_loss(model: Any, ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of each position's logits against the next token (float32)."""
    logits = model(ids[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:]).mean()


def train_step(model: Any, optimizer: nnx.Optimizer, ids: jax.Array) -> jax.Array:
    """One AdamW step on the batch; returns the loss before it."""
    loss, grads = nnx.value_and_grad(next_token_loss)(model, ids)
    optimizer.update(model, grads)
    return loss


def train(checkpoint: str | Path, out: Path, *, mesh: jax.sharding.Mesh, batch: np.ndarray, steps: int,
          scan_layers: bool = True) -> dict[str, Any]:
    """Load ``checkpoint`` while compiling the step, train ``steps`` steps on ``batch``, save a native
    checkpoint under ``out/native``, restore it and export the restored weights to ``out/hf``.
    Returns the losses, the start-up times, the trained and the restored model."""
    tx = optax.adamw(LEARNING_RATE)
    ids = jax.device_put(jnp.asarray(batch, jnp.int32), NamedSharding(mesh, P()))
    ids_shape = jax.ShapeDtypeStruct(ids.shape, ids.dtype, sharding=ids.sharding)

    def compile_step(abstract: nnx.Module) -> tuple[Any, nnx.Optimizer]:
        """The step compiled for the abstract model and optimizer (shapes and shardings only)."""
        opt_shape = abstract_optimizer(abstract, tx, mesh)
        step = nnx.jit(train_step, in_shardings=(shardings_of(abstract), shardings_of(opt_shape), ids.sharding))
        return step.lower(abstract, opt_shape, ids_shape).compile(), opt_shape

    startup = load_while_compiling(checkpoint, compile_step, mesh=mesh, scan_layers=scan_layers, dtype=jnp.float32)
    step, opt_shape = startup.compiled
    model = startup.model
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    place_like(optimizer, opt_shape)  # optax puts its step count on one device; the step wants it replicated
    with jax.set_mesh(mesh):
        losses = [float(step(model, optimizer, ids)) for _ in range(steps)]

    # A native checkpoint of the parameters and the optimizer state, its layout recorded.
    origin = origin_of(model)
    assert origin is not None  # from_pretrained records the config and family it built from
    state = {"params": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
             "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
    metadata = LayoutMetadata(scan_layers=scan_layers, family=origin.family, model_type=origin.config["model_type"],
                              hf_config=origin.config)
    manager = create_manager(CheckpointConfig(out / "native"))
    manager.save(steps, state, metadata=metadata, wait=True)
    manager.close()

    # Restore: the layout the checkpoint records, onto abstract targets of the same shardings.
    manager = create_manager(CheckpointConfig(out / "native"))
    restored_scan = resolve_checkpoint_scan_layers(manager, requested=None)
    restored = abstract_model(checkpoint, mesh=mesh, scan_layers=restored_scan, dtype=jnp.float32)
    restored_opt = abstract_optimizer(restored, tx, mesh)
    target = {"params": nnx.to_pure_dict(nnx.state(restored, nnx.Param)),
              "optimizer": nnx.to_pure_dict(nnx.state(restored_opt))}
    values = manager.restore(None, target)
    manager.close()
    for module, pure in ((restored, values["params"]), (restored_opt, values["optimizer"])):
        module_state = nnx.state(module)
        nnx.replace_by_pure_dict(module_state, pure)
        nnx.update(module, module_state)

    otfload.export_hf(restored, out / "hf", reference=checkpoint, overwrite=True)
    return {"losses": losses, "times": startup.times, "model": model, "optimizer": optimizer,
            "restored": restored, "restored_optimizer": restored_opt, "scan_layers": restored_scan}


def tiny_llama(path: Path) -> Path:
    """A tiny random Llama checkpoint (no network)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    LlamaForCausalLM(config).save_pretrained(path, max_shard_size="100KB")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="what from_pretrained loads (default: a tiny Llama)")
    parser.add_argument("out", nargs="?", default="train-out", help="output directory")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--mesh", default="fsdp=2,tp=4")
    parser.add_argument("--unscanned", action="store_true", help="one parameter per layer (scan_layers=False)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    checkpoint = args.checkpoint or tiny_llama(out / "base")
    mesh = otfload.make_mesh(args.mesh)
    batch = np.random.default_rng(0).integers(0, 256, (2, 16))
    result = train(checkpoint, out, mesh=mesh, batch=batch, steps=args.steps, scan_layers=not args.unscanned)
    times = result["times"]
    print(f"losses {[round(x, 4) for x in result['losses']]}", file=sys.stderr)
    print(f"plan {times.planned:.2f}s, loaded {times.loaded:.2f}s, compiled {times.compiled:.2f}s, "
          f"first step ready {times.ready:.2f}s; HF checkpoint in {out / 'hf'}")


if __name__ == "__main__":
    main()
