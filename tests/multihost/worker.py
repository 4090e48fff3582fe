"""The program each JAX process of a multi-process test runs: join the job, load through the cache, report.

    python -m tests.multihost.worker SPEC_JSON PROCESS_ID

``SPEC_JSON`` (a file) says: ``processes``, ``local_devices``, ``port`` (the coordinator's),
``source`` + ``source_options`` (+ ``retry``, RetryPolicy fields), ``cache_dir`` (+
``cache_options``; null: read straight from the source), ``timeout_s``, ``window_bytes``, ``out``
(a directory) and ``mode``: ``load`` (load the model on a ``fsdp=processes, tp=local_devices``
mesh; write ``proc<i>.json`` with bytes read, the ideal bytes and the files fetched, and unless
``gather`` is false, process 0 ``params.npz`` with every parameter gathered), ``fill`` (only fill
the cache) or ``stall`` (process 0 fills the cache while the others sleep ``stall_s``; process 0
writes the error it got).

With ``scenarios`` (``{name: keys}``), the processes run one scenario after the other in one job, each
the spec with its own keys (``mode`` and the rest) and writing into ``out/<name>``: starting JAX
processes costs more than a tiny load. A ``stall`` scenario comes last: its sleeping processes open
no cache, so their shard-cache fills would no longer pair with the others'.
"""

from __future__ import annotations

import json
import math
import sys
import time
import traceback
from pathlib import Path


def ideal_bytes(plan) -> int:
    """Source bytes of the elements this process's devices hold, each distinct shard counted once."""
    from otfload.plan.boxes import box_from_index

    total = 0
    for leaf_plan in plan.leaves.values():
        leaf = leaf_plan.leaf
        indices = leaf.sharding.addressable_devices_indices_map(leaf.shape).values()
        boxes = {box_from_index(index, leaf.shape) for index in indices}
        held = sum(math.prod(b - a for a, b in box) for box in boxes)
        total += leaf_plan.source_bytes * held // max(1, math.prod(leaf.shape))
    return total


def open_cached_source(spec: dict):
    from otfload.cache import ShardCache
    from otfload.sources import open_source
    from otfload.sources.retry import RetryPolicy

    source = open_source(spec["source"], retry=RetryPolicy(**spec.get("retry", {})), **spec.get("source_options", {}))
    if spec.get("cache_dir") is None:
        return source
    return ShardCache(
        source,
        spec["cache_dir"],
        storage_options=spec.get("cache_options"),
        timeout_s=spec.get("timeout_s", 60.0),
        window_bytes=spec.get("window_bytes", 256 << 20),
    )


def load(spec: dict, pid: int, out: Path) -> None:
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental.multihost_utils import process_allgather
    from jax.sharding import Mesh

    import otfload

    source = open_cached_source(spec)
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(spec["processes"], spec["local_devices"]), ("fsdp", "tp"))
    _, plan, _ = otfload.plan_model(source, mesh=mesh)
    model, report = otfload.from_pretrained(source, mesh=mesh, return_report=True)
    result = {
        "process": pid,
        "bytes_read": report.bytes_read,
        "ideal_bytes": ideal_bytes(plan),
        "requests": report.requests,
        "seconds": report.seconds,
        "fetched": getattr(source, "fetched", []),
        "reused": getattr(source, "reused", []),
    }
    (out / f"proc{pid}.json").write_text(json.dumps(result))
    if spec.get("gather", True):
        params = {
            ".".join(map(str, path)): process_allgather(var[...], tiled=True)
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))
        }
        if pid == 0:
            np.savez(out / "params.npz", **params)


def stall(spec: dict, pid: int, out: Path) -> None:
    if pid != 0:
        time.sleep(spec["stall_s"])
        (out / f"proc{pid}.json").write_text(json.dumps({"stalled": spec["stall_s"]}))
        return
    start = time.monotonic()
    try:
        open_cached_source(spec)
        outcome = {"error": None}
    except Exception as e:  # the test checks which error, and its attributes
        outcome = {"error": type(e).__name__, "message": str(e), "attrs": {k: getattr(e, k, None) for k in
                   ("process", "file", "waiter")}}  # fmt: skip
    outcome["seconds"] = time.monotonic() - start
    (out / "proc0.json").write_text(json.dumps(outcome))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    pid = int(sys.argv[2])
    out = Path(spec["out"])

    import jax

    from tests.multihost.launch import join_cpu_job

    join_cpu_job(spec, pid)
    n = spec["processes"]
    modes = {"load": load, "fill": lambda s, p, o: open_cached_source(s), "stall": stall}
    try:
        for name, keys in spec.get("scenarios", {".": {}}).items():
            scenario = {**spec, **keys}
            (out / name).mkdir(exist_ok=True)
            modes[scenario["mode"]](scenario, pid, out / name)
    except BaseException:
        (out / f"proc{pid}.error").write_text(traceback.format_exc())
        raise
    finally:
        if n > 1:
            jax.distributed.shutdown()


if __name__ == "__main__":
    main()
