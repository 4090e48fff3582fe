"""One JAX process of a multi-process export test: join the job, load the checkpoint sharded over
every process, export it, report which shard files this process wrote.

    python -m tests.export.export_worker SPEC_JSON PROCESS_ID

``SPEC_JSON`` (a file) says: ``processes``, ``local_devices``, ``port`` (the coordinator's),
``src`` (an HF checkpoint directory), ``scan_layers``, ``max_shard_size`` and ``out`` (the export
goes to ``out/export``, the report to ``out/proc<i>.json``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def export(spec: dict, pid: int, out: Path) -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    import otfload
    from otfload.export import export_hf, writer

    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(spec["processes"], spec["local_devices"]), ("fsdp", "tp"))
    model = otfload.from_pretrained(spec["src"], mesh=mesh, scan_layers=spec["scan_layers"])
    kernel = model.layers.attn.q.kernel.get_value() if spec["scan_layers"] else model.layers[0].attn.q.kernel.get_value()
    wrote, real = [], writer.write_safetensors

    def record(path, specs, produce):
        wrote.append(path.name)
        real(path, specs, produce)

    writer.write_safetensors = record
    export_hf(model, out / "export", reference=spec["src"], max_shard_size=spec["max_shard_size"])
    report = {"wrote": wrote, "fully_addressable": kernel.is_fully_addressable, "exists": (out / "export").is_dir()}
    (out / f"proc{pid}.json").write_text(json.dumps(report))


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    pid = int(sys.argv[2])

    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", spec["local_devices"])  # before any backend use
    jax.distributed.initialize(f"127.0.0.1:{spec['port']}", num_processes=spec["processes"], process_id=pid,
                               initialization_timeout=60)  # fmt: skip
    try:
        export(spec, pid, Path(spec["out"]))
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
