#!/usr/bin/env bash
# The whole test suite: the main venv's tests (pytest-xdist, 2 workers, one file per worker at a time)
# with the tunix and MaxText venvs' tests running beside them from the start, not after: on a 2-core
# machine the main run leaves a core idle while it starts its workers and while its last files finish,
# and the side venvs fill it (their wall time then overlaps the main run's instead of adding to it).
# The side runs' output is kept in a log each and shown after the main run's; the exit status is the
# first failing run's. Extra arguments go to the main run's pytest.
set -u
cd "$(dirname "$0")/.."
# The run imports the package and the test modules in many processes (xdist workers, three venvs, the
# CLI and worker subprocesses): let Python keep their bytecode, and pytest its rewritten test modules
# (~3 CPU-s a collection), where the environment turned that off.
unset PYTHONDONTWRITEBYTECODE
logs=$(mktemp -d)
PYTHONPATH=. .venv-maxtext/bin/python -m pytest -q -n 2 --dist loadfile tests/maxtext >"$logs/maxtext" 2>&1 &
maxtext=$!
PYTHONPATH=. .venv-tunix/bin/python -m pytest -q -p no:cacheprovider tests/tunix tests/sources/test_hub.py \
  tests/sources/test_http_body.py tests/sources/test_hostile_network.py >"$logs/tunix" 2>&1 &
tunix=$!
.venv/bin/pytest -q -n 2 --dist loadfile --durations=15 "$@"
status=$?
for side in maxtext tunix; do
  wait "${!side}"
  side_status=$?
  echo "== the $side venv's tests (.venv-$side) =="
  if [ "$side_status" -eq 0 ]; then tail -n 1 "$logs/$side"; else cat "$logs/$side"; fi
  [ "$status" -ne 0 ] || status=$side_status
done
rm -rf "$logs"
exit "$status"
