import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md"


def test_checkpoints_guide_code_blocks_run(monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(blocks) >= 5
    monkeypatch.setitem(sys.modules, "my_managers", None)  # the guide registers it; undone afterwards
    exec(compile("\n".join(blocks), str(DOC), "exec"), {"__name__": "checkpoints_guide"})
