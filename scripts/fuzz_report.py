"""Run the header fuzz tests once and print how many cases ended in which outcome.

Usage (from the repository root): ``OTFLOAD_FUZZ_SCALE=1 .venv/bin/python scripts/fuzz_report.py``.
The cases are derandomized, so a given scale always runs the same cases; exit status 1 if any case crashed.
"""

from __future__ import annotations

import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.index import test_header_fuzz as fuzz  # noqa: E402

TESTS = [fuzz.test_random_bytes, fuzz.test_mutated_valid_files, fuzz.test_hostile_headers]


def main() -> int:
    crashes = 0
    start = time.perf_counter()
    for test in TESTS:
        before = sum(fuzz.OUTCOMES.values())
        try:
            test()
        except Exception:  # noqa: BLE001 - a failing property is what this report counts
            crashes += 1
            traceback.print_exc()
        print(f"{test.__name__}: {sum(fuzz.OUTCOMES.values()) - before} cases")
    print(f"total: {sum(fuzz.OUTCOMES.values())} cases in {time.perf_counter() - start:.1f} s, {crashes} crashes")
    for outcome, n in fuzz.OUTCOMES.most_common():
        print(f"  {outcome}: {n}")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
