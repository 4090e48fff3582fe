"""The quantized-load benchmark still runs end to end (a tiny checkpoint; the figures themselves are
measured by hand and recorded in docs/benchmarks.md, never asserted by a timed test)."""

import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.make_quantized import int_layout_quantize, quantization_config, w4a16_dequantize, w4a16_quantize
from tests import forked

ROOT = Path(__file__).resolve().parents[2]


def test_bench_quantized_runs_every_method_and_prints_the_tables(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.bench_quantized", "--size-gib", "0.02", "--repeat", "1",
           "--dir", str(tmp_path / "c")]
    out = forked.run(cmd, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [f"| {kind}-{v} |" for v in ("bf16", "fp8", "w4a16", "gptq", "awq") for kind in ("floor", "otfload")]
    rows += ["load time / otfload-bf16 load time", "bytes read (LoadReport) / bf16 checkpoint on disk",
             "load time / own floor time", "device bytes (all leaves, all devices; measured)", "| widen codes |"]
    for row in rows:
        assert row in out.stdout, row
    for variant in ("fp8", "w4a16", "gptq", "awq"):
        assert (tmp_path / f"c-{variant}" / "config.json").exists(), variant


def test_w4a16_packing_follows_the_documented_bit_layout():
    # Codes 0..7, -7..0 repeated over one row of 128, scale 0.25 (bf16-exact): element i must sit at
    # bits [4i, 4i+4) of the row's little-endian bit stream, stored + 8.
    codes = np.tile(np.r_[0:8, -7:1], 8)
    packed, scale, shape = w4a16_quantize((codes * 0.25).astype(np.float32)[None, :])
    assert packed.dtype == np.int32 and packed.shape == (1, 16) and shape.tolist() == [1, 128]
    assert scale.astype(np.float32).tolist() == [[0.25]]
    stream = int.from_bytes(packed.astype("<i4").tobytes(), "little")
    assert [(stream >> (4 * i)) & 0xF for i in range(128)] == (codes + 8).tolist()
    np.testing.assert_array_equal(w4a16_dequantize(packed, scale)[0], codes * 0.25)


@pytest.mark.parametrize("variant", ["gptq", "awq"])
def test_gptq_and_awq_copies_hold_the_w4a16_values(variant):
    """The GPTQ and AWQ benchmark copies are the W4A16 codes and scales in another layout: decoded by
    otfload's own handler they equal the W4A16 reference value (so the benchmark compares layouts)."""
    from otfload.index.header import TensorInfo
    from otfload.index.quant.methods.intlinear import awq, gptq

    w = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32) * 0.05
    packed, scale, _ = w4a16_quantize(w)
    stored = int_layout_quantize(variant, w)
    tensors = {f"m.{role}": TensorInfo(f"m.{role}", v.dtype, v.shape, "f", 0, v.nbytes) for role, v in stored.items()}
    (gptq if variant == "gptq" else awq)(quantization_config(variant), tensors, lambda infos: [])
    tensor = tensors["m.weight"]
    box = ((0, 64), (0, 256))
    roles = {"codes": "qweight", "scale": "scales", "zero_point": "qzeros"}
    parts = {role: stored[name] for role, name in roles.items()}
    read = {r: parts[r][tuple(slice(a, b) for a, b in pb)] for r, (_, pb) in tensor.part_boxes(box).items()}
    got = tensor.decode(read, box)
    np.testing.assert_array_equal(got, w4a16_dequantize(packed, scale))
