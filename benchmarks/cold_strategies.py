"""Raw read strategies for a checkpoint's tensors, cold or warm: what the local reader's design rests on.

    python -m benchmarks.cold_strategies --size-gib 1.0 [--repeat 3] [--warm] [--cases m_copy_2w,p_copy_2w_ra]

No JAX, no plan: every tensor of the checkpoint is copied into a fresh buffer of its own (as a
builder does), in load order (leaf by leaf: every layer's ``q_proj``, then every ``k_proj``, ...),
by 1 or 2 threads, the page cache dropped before each run (root) unless ``--warm``. Cases:

* ``m_copy``: read-only mmap, ``posix_fadvise(WILLNEED)`` + ``MADV_POPULATE_READ`` of the tensor,
  one copy into the buffer, ``MADV_DONTNEED`` after (what :class:`~otfload.sources.LocalSource` does);
* ``p_copy``: ``preadv`` into reused scratch, then a copy into the buffer (two copies);
* ``p_direct``: ``preadv`` straight into the buffer (one copy; only whole tensors can be read so);
* ``o_copy``: ``O_DIRECT`` ``preadv`` of the tensor's 4 KiB-aligned span into reused aligned scratch
  (the page cache neither read nor filled), then one copy into the buffer;
* suffix ``_ra``: plus a thread announcing every tensor in order with ``WILLNEED`` (a read-ahead).

Prints wall and CPU seconds of each run.
"""

from __future__ import annotations

import argparse
import mmap
import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks import harness

ADVISE_BYTES = 8 << 20  # as otfload.sources.local.ADVISE_CHUNK_BYTES
MADV_POPULATE_READ = 22
DIRECT_ALIGN = 4096  # O_DIRECT: offsets, lengths and buffers aligned to the logical block size (<= 4 KiB)

Tensor = tuple[str, str, int, int]  # key, file, offset, length


def load_order(directory: Path) -> list[Tensor]:
    """Every tensor of ``directory``, leaf by leaf (layer indices removed), as a loader reads them."""
    tensors = []
    for path in sorted(directory.glob("*.safetensors")):
        header, data_start = harness.safetensors_header(path)
        for key, meta in header.items():
            start, end = meta["data_offsets"]
            tensors.append((key, path.name, data_start + start, end - start))
    leaf_order: dict[str, int] = {}
    for key, *_ in tensors:
        leaf_order.setdefault(re.sub(r"\.\d+\.", ".N.", key), len(leaf_order))
    return sorted(tensors, key=lambda t: (leaf_order[re.sub(r"\.\d+\.", ".N.", t[0])], t[0]))


class Strategies:
    def __init__(self, directory: Path):
        self.tensors = load_order(directory)
        self.fds = {f: os.open(directory / f, os.O_RDONLY) for f in {t[1] for t in self.tensors}}
        self.direct_fds = {f: os.open(directory / f, os.O_RDONLY | os.O_DIRECT) for f in self.fds}
        self.maps: dict[str, mmap.mmap] = {}
        self.local = threading.local()

    def _advise(self, fd: int, offset: int, length: int) -> None:
        for at in range(offset, offset + length, ADVISE_BYTES):
            os.posix_fadvise(fd, at, min(ADVISE_BYTES, offset + length - at), os.POSIX_FADV_WILLNEED)

    def read_ahead(self, stop: threading.Event) -> None:
        for _, file, offset, length in self.tensors:
            if stop.is_set():
                return
            self._advise(self.fds[file], offset, length)

    def m_copy(self, t: Tensor) -> np.ndarray:
        _, file, offset, length = t
        region, start = self.maps[file], offset - offset % mmap.PAGESIZE
        self._advise(self.fds[file], offset, length)
        region.madvise(MADV_POPULATE_READ, start, offset + length - start)
        out = np.empty(length, np.uint8)
        out[:] = np.frombuffer(region, np.uint8, length, offset)
        region.madvise(mmap.MADV_DONTNEED, start, offset + length - start)
        return out

    def _preadv(self, fd: int, offset: int, view: memoryview) -> None:
        done = 0
        while done < len(view):
            done += os.preadv(fd, [view[done:]], offset + done)

    def p_copy(self, t: Tensor) -> np.ndarray:
        _, file, offset, length = t
        scratch = getattr(self.local, "scratch", None)
        if scratch is None or len(scratch) < length:
            scratch = self.local.scratch = np.empty(length, np.uint8)
        self._preadv(self.fds[file], offset, memoryview(scratch)[:length])
        out = np.empty(length, np.uint8)
        out[:] = scratch[:length]
        return out

    def o_copy(self, t: Tensor) -> np.ndarray:
        _, file, offset, length = t
        start = offset - offset % DIRECT_ALIGN
        span = -(-(offset + length - start) // DIRECT_ALIGN) * DIRECT_ALIGN
        scratch = getattr(self.local, "aligned", None)
        if scratch is None or len(scratch) < span:
            scratch = self.local.aligned = np.frombuffer(mmap.mmap(-1, span), np.uint8)  # page-aligned
        view, done = memoryview(scratch)[:span], 0
        while done < span:
            n = os.preadv(self.direct_fds[file], [view[done:]], start + done)
            if n == 0:  # the file's end (the span's last block was partial)
                break
            done += n
        out = np.empty(length, np.uint8)
        out[:] = scratch[offset - start : offset - start + length]
        return out

    def p_direct(self, t: Tensor) -> np.ndarray:
        _, file, offset, length = t
        out = np.empty(length, np.uint8)
        self._preadv(self.fds[file], offset, memoryview(out))
        return out

    def run(self, method: str, workers: int, ahead: bool) -> tuple[float, float]:
        """``(wall, CPU)`` seconds of one pass over every tensor."""
        self.maps = {f: mmap.mmap(fd, 0, access=mmap.ACCESS_READ) for f, fd in self.fds.items()}
        stop, thread = threading.Event(), None
        cpu, start = harness.cpu_seconds(), time.perf_counter()
        if ahead:
            thread = threading.Thread(target=self.read_ahead, args=(stop,))
            thread.start()
        with ThreadPoolExecutor(workers) as pool:
            out = list(pool.map(getattr(self, method), self.tensors))
        wall = time.perf_counter() - start
        stop.set()
        if thread is not None:
            thread.join()
        del out
        return wall, harness.cpu_seconds() - cpu


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: bench_data/...)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--warm", action="store_true", help="keep the page cache (default: drop it before each run)")
    parser.add_argument("--cases", default="m_copy_2w,m_copy_2w_ra,p_copy_2w,p_copy_2w_ra,p_direct_2w_ra")
    args = parser.parse_args(argv)
    if args.dir is None:
        from benchmarks.make_checkpoint import ensure_checkpoint

        args.dir = ensure_checkpoint(args.size_gib, False)
    strategies = Strategies(args.dir)
    cases = args.cases.split(",")
    runs: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    how = "warm" if args.warm else None
    for _ in range(args.repeat):
        for case in cases:
            ahead = case.endswith("_ra")
            method, workers = case.removesuffix("_ra").rsplit("_", 1)  # "m_copy_2w" -> m_copy, 2 threads
            if not args.warm:
                how = harness.drop_caches(args.dir)
            time.sleep(0.2)
            runs[case].append(strategies.run(method, int(workers.rstrip("w")), ahead))
    print(f"{args.dir}: {len(strategies.tensors)} tensors, page cache: {how}, {harness.load_line()}")
    for case, results in runs.items():
        cells = ", ".join(f"{w:.2f} s (CPU {c:.2f})" for w, c in results)
        print(f"{case:16s} {cells}")


if __name__ == "__main__":
    main()
