"""What the benchmarks' smoke tests share: ``benchmarks.make_checkpoint``'s smallest checkpoints."""

import pytest

from benchmarks.make_checkpoint import ensure_checkpoint

SIZE_GIB = 0.02


@pytest.fixture(scope="session")
def bench_checkpoint(tmp_path_factory):
    """``bench_checkpoint(moe=False) -> directory``: the 0.02 GiB Llama-shaped checkpoint (Mixtral-shaped
    with ``moe``) that ``python -m benchmarks.make_checkpoint --size-gib 0.02`` writes, once per session."""
    root = tmp_path_factory.mktemp("bench")
    return lambda moe=False: ensure_checkpoint(SIZE_GIB, moe, out=root / ("mixtral" if moe else "llama"))
