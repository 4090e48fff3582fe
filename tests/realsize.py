"""Checkpoints at a published model's full size with headers only: every safetensors file holds a
real header and a sparse (unwritten) data section of the right length, so planning (``otfload
inspect``, :func:`otfload.plan_model`) reads what it would from the real files, without the bytes."""

from __future__ import annotations

import json
import math
import os
import resource
import struct
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

# safetensors dtype -> bytes per element
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I32": 4, "I64": 8, "U8": 1}
Spec = tuple[str, tuple[int, ...]]  # (safetensors dtype, shape)


def write_header_checkpoint(path: Path, shards: Mapping[str, Mapping[str, Spec]], config: dict) -> Path:
    """``path`` with one sparse safetensors file per ``shards`` entry (file name -> {key: (dtype, shape)}),
    the index and ``config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for name, tensors in shards.items():
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, (dtype, shape) in tensors.items():
            size = math.prod(shape) * ITEMSIZE[dtype]
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[key] = name
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path / name, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


def fp8_linear(key: str, out: int, inp: int, block: tuple[int, int] = (128, 128)) -> dict[str, Spec]:
    """An FP8 block-scaled linear weight ``[out, in]`` and its float32 ``weight_scale_inv`` grid."""
    return {key: ("F8_E4M3", (out, inp)),
            f"{key}_scale_inv": ("F32", (-(-out // block[0]), -(-inp // block[1])))}


# A child running ``otfload ARGS`` that reports its own peak resident set on stderr (``PEAK n``).
PEAK_PROBE = ("import sys\nfrom otfload.cli import main\nfrom otfload.place.report import peak_rss\ntry:\n"
              "    code = main(sys.argv[1:])\nfinally:\n    sys.stderr.write(f'PEAK {peak_rss()}\\n')\nsys.exit(code)")


def inspect_at_scale(path: Path, mesh: str, devices: int = 256, processes: int = 32) -> tuple[float, int, dict]:
    """``otfload inspect --json`` of ``path`` for process 0 of ``processes`` on ``devices`` devices, in a
    child: ``(its CPU seconds, its own peak resident bytes, the plan)``. CPU time, not wall time: on a
    shared test machine the wall time measures the neighbours."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = subprocess.run([sys.executable, "-c", PEAK_PROBE, "inspect", str(path), "--devices", str(devices),
                          "--mesh", mesh, "--process-index", "0", "--process-count", str(processes), "--json"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "TQDM_DISABLE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    assert run.returncode == 0, run.stderr[-2000:]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, int(run.stderr.rsplit("PEAK ", 1)[1].split()[0]), json.loads(run.stdout)
