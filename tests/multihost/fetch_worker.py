"""One JAX process of a multi-process load that measures what it fetched (issue 17).

    python -m tests.multihost.fetch_worker SPEC_JSON PROCESS_ID

``SPEC_JSON`` (a file) says: ``processes``, ``local_devices``, ``port``, ``mesh`` (``{"fsdp": 8}`` or
``{"fsdp": 2, "tp": 4}``; devices in process order), ``source`` (a directory; ``{i}`` is replaced by
the process id, so each process can read its own copy — separate hosts do not share a page cache) or
a Hub repo with ``endpoint``, ``reshard`` (the policy, set as ``$OTFLOAD_RESHARD``), ``evict`` (drop
the files from the page cache first: a cold read), ``digest`` (the result lists, for every
parameter, the box and sha256 of each of this process's shards: the loaded values, compared bit by
bit without gathering them) and ``out``. Writes ``proc<i>.json``: the report's counts (read,
requests, planned, ideal, resharded leaves), the kernel's ``/proc/self/io`` ``read_bytes`` during
the load and the seconds it took.

With ``loads`` (a list of ``{"reshard": POLICY}`` — passed as ``from_pretrained(reshard=...)`` — or
``{"env": POLICY}`` — set as ``$OTFLOAD_RESHARD``, ``reshard=None``), the processes run those loads
one after the other in one job (each cold when ``evict``), and ``proc<i>.json`` is ``{"loads": [one
result per load]}``. A load's entry may also set any of the spec's keys for that load alone
(``mesh``, ``source``, ``endpoint``, ``evict``, ``digest``): one job
then checks several meshes and checkpoints, paying for process start-up and ``initialize`` once;
and ``only`` (the processes that run it, the others skip it: no start barrier then), ``local_mesh``
(the mesh over this process's own devices), ``timeout`` (``$OTFLOAD_COLLECTIVE_TIMEOUT``),
``mismatch`` (the process whose read layouts drop their first band: a forced disagreement) and
``expect_error`` (an :class:`~otfload.errors.OtfloadError` is recorded, not raised); ``evict_except``
(a process that keeps its page cache when the others evict); ``mmap`` (false: local files read with
``preadv``); ``warm`` (read the files whole just before the load).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path


def disk_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def read_whole(directory: Path) -> None:
    """Read every safetensors file of ``directory`` once, just before the load: all its pages resident
    (on this shared VM pages of a file read a minute earlier are partly gone)."""
    for path in directory.glob("*.safetensors"):
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass


def evict(directory: Path) -> None:
    """Drop ``directory``'s safetensors files from the page cache (clean pages only)."""
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(spec: dict, pid: int, out: Path) -> None:
    if "loads" not in spec:
        os.environ["OTFLOAD_RESHARD"] = spec.get("reshard", "auto")
        (out / f"proc{pid}.json").write_text(json.dumps(load_once(spec, pid, out, None)))
        return
    results = []
    for k, how in enumerate(spec["loads"]):
        os.environ.pop("OTFLOAD_RESHARD", None)
        if "env" in how:
            os.environ["OTFLOAD_RESHARD"] = how["env"]
        if "only" in how and pid not in how["only"]:
            results.append({"process": pid, "skipped": True})
            continue
        os.environ.pop("OTFLOAD_COLLECTIVE_TIMEOUT", None)
        if "timeout" in how:
            os.environ["OTFLOAD_COLLECTIVE_TIMEOUT"] = str(how["timeout"])
        results.append(load_once({**spec, **how}, pid, out, how.get("reshard"), f"-{k}"))
    (out / f"proc{pid}.json").write_text(json.dumps({"loads": results}))


def load_once(spec: dict, pid: int, out: Path, reshard: str | None, tag: str = "") -> dict:
    """One measured load on every process (``reshard`` passed to ``from_pretrained``); its result."""
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental.multihost_utils import sync_global_devices
    from jax.sharding import Mesh

    import otfload
    from otfload.sources import open_source

    devices = sorted(jax.local_devices() if spec.get("local_mesh") else jax.devices(),
                     key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(tuple(spec["mesh"].values())), tuple(spec["mesh"]))
    if "endpoint" in spec:
        source = open_source(spec["source"], endpoint=spec["endpoint"], cache_dir=str(out / f"hf{pid}{tag}"))
    else:
        directory = Path(spec["source"].format(i=pid))
        # the modules a load imports on first use (the family packages, ...) read now, not in the
        # measured window: the kernel's read_bytes below should count the checkpoint's reads only
        otfload.plan_model(directory, mesh=mesh)[2].close()
        if spec.get("evict") and spec.get("evict_except") != pid:
            evict(directory)
        if spec.get("warm"):
            read_whole(directory)
        source = open_source(directory, mmap=spec.get("mmap", True))
    if "only" not in spec:
        sync_global_devices(f"otfload-fetch-start{tag}")  # every process evicted before any reads
    before, start = disk_read_bytes(), time.perf_counter()
    try:
        with forced_mismatch(spec.get("mismatch") == pid):
            model, report = otfload.from_pretrained(source, mesh=mesh, return_report=True, progress=False,
                                                    reshard=reshard)  # fmt: skip
    except otfload.OtfloadError as e:
        if not spec.get("expect_error"):
            raise
        source.close()
        return {"process": pid, "error": type(e).__name__, "message": str(e), "leaf": getattr(e, "leaf", None),
                "processes": getattr(e, "processes", None), "seconds": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    result = {
        "process": pid,
        "bytes_read": report.bytes_read,
        "requests": report.requests,
        "bytes_planned": report.bytes_planned,
        "bytes_ideal": report.bytes_ideal,
        "bytes_needed": report.bytes_needed,
        "kernel_read_bytes": disk_read_bytes() - before,
        "resharded": report.resharded,
        "route": report.route,
        "reshard_seconds": report.reshard_seconds,
        "seconds": seconds,
        "summary": report.summary(),
    }
    if spec.get("digest", False):
        result["shards"] = {".".join(map(str, path)): shard_digests(var[...])
                            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}  # fmt: skip
    source.close()
    return result


def shard_digests(array) -> list[tuple[tuple[tuple[int, int], ...], str]]:
    """``(box, sha256 of its bytes)`` of each of this process's shards of ``array``."""
    import numpy as np

    from otfload.plan.boxes import box_from_index

    return [(box_from_index(s.index, array.shape), hashlib.sha256(np.asarray(s.data).tobytes()).hexdigest())
            for s in array.addressable_shards]  # fmt: skip


@contextlib.contextmanager
def forced_mismatch(on: bool) -> Iterator[None]:
    """While on, this process's read layouts drop the first band the others choose (a stand-in for
    any process-local difference in a choice): the load must end in a typed error, not a hang."""
    from otfload.place import loader

    if not on:
        yield
        return
    choose = loader.choose_read_shardings

    def fewer(*args, **kwargs):
        chosen = choose(*args, **kwargs)
        return dict(list(chosen.items())[1:])

    loader.choose_read_shardings = fewer
    try:
        yield
    finally:
        loader.choose_read_shardings = choose


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    pid = int(sys.argv[2])
    out = Path(spec["out"])

    import jax

    from tests.multihost.launch import join_cpu_job

    join_cpu_job(spec, pid)
    n = spec["processes"]
    try:
        load(spec, pid, out)
    except BaseException:
        (out / f"proc{pid}.error").write_text(traceback.format_exc())
        raise
    finally:
        if n > 1:
            jax.distributed.shutdown()


if __name__ == "__main__":
    main()
