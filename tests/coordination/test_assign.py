"""assign_files: which process fetches which file, checked against its contract on hand-made sizes."""

from __future__ import annotations

import pytest

from otfload.coordination import assign_files


def test_assignment_is_deterministic_complete_and_size_balanced():
    sizes = {f"f{i}": s for i, s in enumerate([90, 10, 40, 40, 30, 30, 5, 5, 1])}
    owners = assign_files(sizes, 3)
    assert owners == assign_files(dict(reversed(sizes.items())), 3)  # independent of listing order
    assert set(owners) == set(sizes) and set(owners.values()) == {0, 1, 2}
    loads = [sum(sizes[f] for f, p in owners.items() if p == proc) for proc in range(3)]
    assert max(loads) - min(loads) <= max(sizes.values())  # greedy largest-first bound
    assert set(assign_files(sizes, 1).values()) == {0}
    with pytest.raises(ValueError):
        assign_files(sizes, 0)
