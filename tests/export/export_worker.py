"""One JAX process of a multi-process export test: join the job, load the checkpoint sharded over
every process (scanned, then unscanned), export each, report which shard files this process wrote.

    python -m tests.export.export_worker SPEC_JSON PROCESS_ID

``SPEC_JSON`` (a file) says: ``processes``, ``local_devices``, ``port`` (the coordinator's),
``src`` (an HF checkpoint directory), ``max_shard_size`` and ``out`` (the exports go to
``out/scanned`` and ``out/unscanned``, the report to ``out/proc<i>.json``).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

LAYOUTS = {"scanned": True, "unscanned": False}


def recording(write, names: list[str]):
    """``write`` (``writer.write_safetensors``), appending the name of each file it writes to ``names``."""

    def record(path, specs, produce, *written):
        names.append(path.name)
        write(path, specs, produce, *written)

    return record


def export(spec: dict, out: Path) -> dict:
    import jax
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    import otfload
    from otfload.export import export_hf, writer

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(spec["processes"], spec["local_devices"]), ("fsdp", "tp"))
    real, report = writer.write_safetensors, {}
    for name, scan in LAYOUTS.items():
        model = otfload.from_pretrained(spec["src"], mesh=mesh, scan_layers=scan)
        params = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(model, nnx.Param))]
        wrote: list[str] = []
        writer.write_safetensors = recording(real, wrote)
        export_hf(model, out / name, reference=spec["src"], max_shard_size=spec["max_shard_size"])
        report[name] = {"wrote": wrote, "exists": (out / name).is_dir(),
                        "split": sum(not p.is_fully_addressable for p in params)}  # fmt: skip
    return report


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    pid = int(sys.argv[2])

    import jax

    from tests.multihost.launch import join_cpu_job

    join_cpu_job(spec, pid)
    out = Path(spec["out"])
    try:
        (out / f"proc{pid}.json").write_text(json.dumps(export(spec, out)))
    except BaseException:
        traceback.print_exc()  # now: shutdown() waits for the other process
        sys.stderr.flush()
        raise
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
