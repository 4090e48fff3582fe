"""Checks the family test modules share: a load on a named mesh, logits parity with the experts
expert-parallel where the mesh has an ``ep`` axis, greedy decoding with the cache against transformers'
``generate``, the export round trip, the sparse replica of a published config the real-size
planning tests plan, and transformers' references computed once per tiny model and input."""

from __future__ import annotations

import contextlib
import json
import weakref
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import otfload
from otfload.export import export_hf
from otfload.plan.sharding import make_mesh
from tests.export.test_export import assert_bit_exact, read_tensors, weight_map_keys
from tests.helpers import jax_logits, jitted_forward, max_rel_diff, token_ids, torch_logits

MESHES = {"fsdp2_tp4": {"fsdp": 2, "tp": 4}, "fsdp2_ep4": {"fsdp": 2, "ep": 4}}
NEW = 6  # tokens each greedy check generates
# transformers' outputs by torch model, then by call: a kind's scanned and unscanned cases (and its
# padding sides) compare against the same reference, which on the hybrids' PyTorch reference kernels
# takes seconds; the session's tiny torch models are never changed in place.
_REFERENCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _once(torch_model, key: tuple, compute: Callable[[], np.ndarray]) -> np.ndarray:
    per_model = _REFERENCES.setdefault(torch_model, {})
    if key not in per_model:
        per_model[key] = compute()
    return per_model[key].copy()


def reference_logits(torch_model, ids: np.ndarray) -> np.ndarray:
    """:func:`tests.helpers.torch_logits`, computed once per torch model and ``ids``."""
    key = ("logits", ids.dtype.str, ids.shape, ids.tobytes())
    return _once(torch_model, key, lambda: torch_logits(torch_model, ids))


def reference_greedy(torch_model, ids: np.ndarray, mask: np.ndarray, new: int, **kw) -> np.ndarray:
    """:func:`tests.models.kinds.torch_greedy`, computed once per torch model and arguments."""
    from tests.models.kinds import torch_greedy  # it imports the family modules, which import this

    key = ("greedy", ids.dtype.str, ids.shape, ids.tobytes(), mask.tobytes(), new, tuple(sorted(kw.items())))
    return _once(torch_model, key, lambda: torch_greedy(torch_model, ids, mask, new, **kw))


def load_sharded(tiny_checkpoints, kind: str, mesh_name: str, scan_layers: bool, **kw):
    """``(model, torch model, mesh)``: ``kind``'s tiny checkpoint (several shards) loaded on the mesh of
    ``MESHES`` named ``mesh_name``; ``kw`` goes to ``from_pretrained`` (``return_report=True`` makes
    ``model`` a ``(model, report)`` pair)."""
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    mesh = make_mesh(MESHES[mesh_name])
    return otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, **kw), torch_model, mesh


def expert_parallel_diff(model, torch_model, mesh, experts, scan_layers: bool) -> float:
    """The max relative difference of ``model``'s 12-token logits to transformers', after asserting
    that ``experts`` (an expert kernel of the first MoE layer, the whole stack when scanned) sits on
    ``ep`` exactly when ``mesh`` has that axis, and that the forward then runs the experts
    expert-parallel (a ``shard_map`` over ``ep``)."""
    has_ep = "ep" in mesh.axis_names
    spec = experts.sharding.spec
    assert spec[1 if scan_layers else 0] == ("ep" if has_ep else None), spec
    ids = token_ids(seq=12)
    with jax.set_mesh(mesh):
        # traced through the session's jitted forward, whose call below then reuses the trace
        assert ("shard_map" in str(jitted_forward().trace(model, jnp.asarray(ids)).jaxpr)) == has_ep
        return max_rel_diff(jax_logits(model, ids), reference_logits(torch_model, ids))


def assert_greedy_matches(model, torch_model, *, mesh=None, crop: int = 4, no_eos: bool = False) -> None:
    """Greedy decoding with the cache: ``NEW`` tokens after left-padded prompts (the padded test batch
    less its first ``crop`` columns) equal transformers' ``generate``; ``no_eos`` decodes past EOS on
    both sides. Under ``mesh`` (``jax.set_mesh``) when one is given."""
    from tests.models.kinds import padded_batch  # it imports the family modules, which import this

    ids, mask, _ = padded_batch("left")
    ids, mask = ids[:, crop:], mask[:, crop:]
    kw = {"eos_token_id": []} if no_eos else {}
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        ours = np.asarray(otfload.generate(model, ids, max_new_tokens=NEW, attention_mask=mask, **kw))
    torch_kw = {"eos_token_id": None} if no_eos else {}
    np.testing.assert_array_equal(ours, reference_greedy(torch_model, ids, mask, NEW, **torch_kw))


def assert_export_round_trip(
    model, src: Path, out: Path, *, kept: Callable[[str], bool] = lambda key: True, ordered: bool = True
) -> None:
    """``model`` exported next to its checkpoint ``src`` is bit-exact, tensor by tensor, with the tensors
    of ``src`` that ``kept`` accepts (a multimodal checkpoint's text model: its vision tower is never
    loaded), under the same weight-map keys (compared as sets unless ``ordered``)."""
    written = export_hf(model, out, reference=src, max_shard_size="60KB")
    assert_bit_exact(read_tensors(written), {k: v for k, v in read_tensors(src).items() if kept(k)})
    keys = [k for k in weight_map_keys(src) if kept(k)]
    if ordered:
        assert weight_map_keys(written) == keys
    else:
        assert set(weight_map_keys(written)) == set(keys)


def write_replica(directory: Path, tensors: list[tuple[str, str, tuple[int, ...]]], config: dict) -> Path:
    """A sparse replica of a published checkpoint in ``directory``: ``tensors`` (name, dtype, shape) in
    two safetensors files with their real headers and holes for the data (``scripts/make_replica.py``),
    their index, and ``config`` as its ``config.json``."""
    from tests.place.test_plan_scale import replica_module

    make = replica_module()
    half = len(tensors) // 2
    weight_map = {}
    for k, part in enumerate((tensors[:half], tensors[half:])):
        file = f"model-{k + 1:05d}-of-00002.safetensors"
        make.write_shard(directory / file, part)
        weight_map.update(dict.fromkeys((t[0] for t in part), file))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "config.json").write_text(json.dumps(config))
    return directory
