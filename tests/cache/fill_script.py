"""Run shard-cache fills in a process of its own and report each outcome as JSON (one line on stdout).

    python -m tests.cache.fill_script SPEC_JSON

``SPEC_JSON`` (a file) says: ``source`` (a URL ``open_source`` takes), ``runs`` (a list of
``{"cache_dir": ..., "verify": ...}``, run in order) and ``fsize_limit`` (bytes, or null): the
process's ``RLIMIT_FSIZE``, so that writing past it fails with ``EFBIG``. The tests run it under
that limit, or in a private mount namespace where the cache is a read-only bind mount or a tiny
tmpfs: real read-only and full file systems, without touching the machine's own mounts.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path


def run(source_url: str, cache_dir: str, verify: str) -> dict:
    from otfload.cache import ShardCache
    from otfload.coordination import LocalCoordinator
    from otfload.sources import open_source

    outcome: dict = {"error": None, "fetched": [], "reused": []}
    try:
        cache = ShardCache(open_source(source_url), cache_dir, coordinator=LocalCoordinator(), verify=verify)
        outcome.update(fetched=sorted(cache.fetched), reused=sorted(cache.reused))
    except Exception as e:  # the test checks which error and its attributes
        outcome["error"] = {"type": type(e).__name__, "message": str(e), "path": getattr(e, "path", None),
                            "errno": getattr(e, "errno", None)}  # fmt: skip
    outcome["left"] = sorted(str(p.relative_to(cache_dir)) for p in Path(cache_dir).rglob("*") if p.is_file())
    return outcome


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    if spec.get("fsize_limit") is not None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], spec["fsize_limit"]))
    results = [run(spec["source"], r["cache_dir"], r.get("verify", "record")) for r in spec["runs"]]
    sys.stdout.write(json.dumps(results) + "\n")
    sys.stdout.flush()
    os._exit(0)  # no interpreter teardown (JAX threads): the result is out


if __name__ == "__main__":
    main()
