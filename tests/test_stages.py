"""Optional features are stages a load runs only when asked (otfload.stages): a plain load runs
none and imports no adapter code; each option adds its own stage, which owns its checks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from otfload.adapters.config import CONFIG_FILE as ADAPTER_CONFIG
from otfload.api import plan_load
from otfload.errors import AdapterError
from otfload.index.checkpoint import CONFIG_FILE as MODEL_CONFIG
from otfload.options import LoadOptions
from otfload.quantized import QuantizedArray, dequantize
from otfload.sources.owned import owned
from otfload.stages import adapters as adapter_stages


def stage_names(location, **options) -> list[str]:
    planned = plan_load(location, LoadOptions(**options))
    with owned(planned.opened.source, location):
        return [stage.name for stage in planned.stages]


def test_a_plain_load_imports_no_adapter_code(example_checkpoints):
    """In a fresh process (nothing imported by other tests), a whole plain load leaves every
    ``otfload.adapters`` module and the quantized stages unimported."""
    script = textwrap.dedent(f"""
        import sys
        import otfload
        model = otfload.from_pretrained({str(example_checkpoints.llama)!r})
        assert model.embed.embedding.get_value().shape[0] > 0
        print(sorted(m for m in sys.modules if m.startswith(("otfload.adapters", "otfload.stages.quantized"))))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_each_option_adds_its_stage_and_a_plain_load_none(example_checkpoints, mesh_2x4):
    ex = example_checkpoints
    assert stage_names(ex.llama, mesh=mesh_2x4) == []
    assert stage_names(ex.quantized, mesh=mesh_2x4) == []  # dequantised on load: no stage
    assert stage_names(ex.llama, mesh=mesh_2x4, adapter=str(ex.adapter)) == ["adapter"]
    assert stage_names(ex.adapter, mesh=mesh_2x4) == ["adapter"]  # an adapter given as the checkpoint
    assert stage_names(ex.quantized, mesh=mesh_2x4, quantized="keep") == ["kept-quantized"]
    assert stage_names(ex.llama, mesh=mesh_2x4, adapter=str(ex.adapter), merge_adapter=False) == [
        "adapter", "kept-factors"]


def test_the_stages_do_their_work(example_checkpoints, mesh_2x4):
    """What each stage adds is in the loaded model: packed leaves, kept factors, none of either plainly."""
    ex = example_checkpoints
    kept, _ = plan_load(ex.quantized, LoadOptions(mesh=mesh_2x4, quantized="keep")).load()
    plain, _ = plan_load(ex.quantized, LoadOptions(mesh=mesh_2x4)).load()
    q = kept.layers.attn.q.kernel.get_value()
    assert isinstance(q, QuantizedArray)
    assert not isinstance(plain.layers.attn.q.kernel.get_value(), QuantizedArray)
    dense = np.asarray(plain.layers.attn.q.kernel.get_value(), np.float32)
    np.testing.assert_array_equal(np.asarray(dequantize(q), np.float32), dense)
    factored, _ = plan_load(ex.llama, LoadOptions(mesh=mesh_2x4, adapter=str(ex.adapter), merge_adapter=False)).load()
    assert type(factored.layers.attn.q.kernel.get_value()).__name__ == "LoraWeight"


def test_kept_factors_are_refused_for_a_tree_the_caller_brings():
    with pytest.raises(AdapterError, match="bundled models"):
        adapter_stages.KeptFactors(bundled=False)


def test_the_adapter_marker_files_are_the_libraries_own():
    assert adapter_stages.ADAPTER_CONFIG_FILE == ADAPTER_CONFIG
    assert adapter_stages.MODEL_CONFIG_FILE == MODEL_CONFIG
