"""What every benchmark shares: a run in a fresh child process, the measured section of that run,
rounds of runs and their medians, the page cache, and the lines and tables a report prints.

A benchmark's parent starts one child process per run (:func:`run_child`), so the run's peak RSS is
its own and JAX starts on the devices the run asks for. The child times its load inside
:func:`measured` and prints its figures with :func:`report`; the parent interleaves its methods
round by round (:func:`rounds`) and keeps the median of each (:func:`summarize`).

Kept free of JAX and otfload imports: a parent stays light, and the tunix benchmark's parent runs in
tunix's own venv.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
RESULT_PREFIX = "BENCH_RESULT "
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"

# --- child processes ------------------------------------------------------------------------------


def child_env(devices: int | None, platform: str = "cpu") -> dict[str, str]:
    """This process's environment with JAX on ``devices`` simulated CPU devices, or (another
    ``platform``) on the machine's own accelerators; ``devices=None``: as it is."""
    env = dict(os.environ)
    if devices is None:
        return env
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith(DEVICE_COUNT_FLAG)]
    if platform != "cpu":
        env["XLA_FLAGS"] = " ".join(flags)
        env.pop("JAX_PLATFORMS", None)
        return env
    env["XLA_FLAGS"] = " ".join([*flags, f"{DEVICE_COUNT_FLAG}={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return env


def simulate_cpu_devices(devices: int) -> None:
    """Unless the environment already says otherwise, JAX in this process on ``devices`` simulated CPU
    devices (call it before JAX is imported)."""
    os.environ.setdefault("XLA_FLAGS", f"{DEVICE_COUNT_FLAG}={devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def report(result: Mapping[str, Any]) -> None:
    """Print a child's result as the line :func:`run_child` looks for."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def result_of(stdout: str) -> dict[str, Any] | None:
    """The result a child :func:`report` ed in ``stdout`` (``None`` if it printed none)."""
    for line in stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            result: dict[str, Any] = json.loads(line[len(RESULT_PREFIX) :])
            return result
    return None


def run_child(
    module: str, args: Sequence[str], *, devices: int | None = None, platform: str = "cpu",
    env: Mapping[str, str] | None = None, timeout: float | None = None, what: str | None = None,
) -> dict[str, Any]:
    """Run ``python -m module *args`` in a fresh process (JAX as :func:`child_env` sets it up, the
    repository on its path, plus ``env``) and return what it :func:`report` ed; RuntimeError with the end
    of its output (``what`` failed) when it printed nothing."""
    base = child_env(devices, platform)
    path = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", module, *args]
    proc = subprocess.run(cmd, env={**base, "PYTHONPATH": path, **(env or {})}, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    result = result_of(proc.stdout)
    if result is None:
        what = what or " ".join(args)
        raise RuntimeError(f"{what} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return result


# --- the page cache -------------------------------------------------------------------------------


def warm(directory: Path) -> None:
    """Read every file of ``directory`` once so that a run finds it in the page cache."""
    buf = bytearray(16 * 2**20)
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass


def drop_caches(directory: Path, files_only: bool = False) -> str:
    """Empty the page cache of ``directory``'s files (the whole page cache unless ``files_only``);
    returns how it was done: ``echo 3 > /proc/sys/vm/drop_caches`` as root, else
    ``posix_fadvise(DONTNEED)`` on each file, which drops its clean pages for any user."""
    os.sync()
    reason = "--cold-files"
    if not files_only:
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return "drop_caches"
        except OSError as e:  # not root (EACCES/EPERM), or a read-only /proc in a container
            reason = f"{e.strerror} writing /proc/sys/vm/drop_caches"
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return f"posix_fadvise(DONTNEED) per file ({reason})"


# --- measuring a run, in its child ----------------------------------------------------------------


def cpu_seconds() -> float:
    """User + system CPU time of every thread of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def peak_rss() -> int:
    """Peak RSS of this process's own address space so far (``VmHWM``; ``ru_maxrss`` would include
    the peak of the process that spawned it: see ``otfload.place.report.peak_rss``)."""
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.exists() else []
    hwm = [line.split()[1] for line in lines if line.startswith("VmHWM:")]
    return int(hwm[0]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def proc_io() -> dict[str, int]:
    """This process's I/O counters (every thread, and its waited-for children such as ``cat``):
    ``rchar`` (read()-family syscalls; a mapped read makes none), ``read_bytes`` (from storage, not
    the page cache), ``syscr``, ... ({} where ``/proc/self/io`` is unavailable)."""
    try:
        lines = Path("/proc/self/io").read_text().splitlines()
    except OSError:  # not Linux, or /proc hidden
        return {}
    return {k: int(v) for k, v in (line.split(": ") for line in lines)}


def disk_busy_ms() -> int:
    """Milliseconds the machine's disks have spent with I/O in flight (``io_ticks`` of
    ``/proc/diskstats``, whole disks only, summed): over a run, busy / wall says whether the disk
    or the CPU was the bottleneck (machine-wide: other processes' I/O counts too)."""
    try:
        disks = {p.name for p in Path("/sys/block").iterdir() if not p.name.startswith(("loop", "ram", "zram"))}
        total = 0
        for line in Path("/proc/diskstats").read_text().splitlines():
            fields = line.split()
            if len(fields) > 12 and fields[2] in disks:
                total += int(fields[12])
        return total
    except OSError:
        return 0


class RssSampler:
    """A thread sampling this process's RSS every ``interval`` s; ``peak`` is the largest sample."""

    def __init__(self, interval: float = 0.01):
        import psutil

        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._process = psutil.Process(os.getpid())

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._process.memory_info().rss)
            self._stop.wait(self.interval)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def measured() -> Iterator[dict[str, Any]]:
    """Measure the ``with`` block (a run's timed section; wait for its arrays inside it). The dict it
    yields is filled when the block ends: wall and CPU ``seconds``, RSS before and at its peak
    (``ru_maxrss`` or a 10 ms sampler, the larger), page faults, the kernel's I/O counters
    (``disk_bytes``: read from storage; ``rchar``, ``syscr``), the share of the time the disks were
    busy, and the load average."""
    gc.collect()
    figures: dict[str, Any] = {"rss_before": current_rss()}
    usage, io, busy = resource.getrusage(resource.RUSAGE_SELF), proc_io(), disk_busy_ms()
    with RssSampler() as sampler:
        start, cpu = time.perf_counter(), cpu_seconds()
        yield figures
        seconds, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    after, io_after = resource.getrusage(resource.RUSAGE_SELF), proc_io()
    peak = max(peak_rss(), sampler.peak)
    figures.update(
        seconds=seconds, cpu_seconds=cpu, peak_rss=peak, sampled_peak=sampler.peak,
        peak_over_before=peak - figures["rss_before"], minor_faults=after.ru_minflt - usage.ru_minflt,
        major_faults=after.ru_majflt - usage.ru_majflt, disk_busy=(disk_busy_ms() - busy) / 1e3 / seconds if seconds
        else 0.0, loadavg=os.getloadavg()[0], disk_bytes=io_after.get("read_bytes", 0) - io.get("read_bytes", 0),
        **{k: io_after[k] - io[k] for k in ("rchar", "syscr") if k in io_after},
    )  # fmt: skip


def times(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``repeat`` calls of ``fn`` (which waits for its own results), after
    ``warmup`` untimed ones (compiling, first-touch)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


# --- rounds of runs, in the parent ----------------------------------------------------------------


def progress(result: Mapping[str, Any]) -> str:
    """A run's figures for its progress line."""
    line = f"{result['seconds']:7.2f} s  cpu {result['cpu_seconds']:6.2f} s"
    if "peak_rss" in result:
        line += f"  peak {result['peak_rss'] / GIB:5.2f} GiB"
    if "loadavg" in result:
        line += f"  load avg {result['loadavg']:.2f}"
    return line


def rounds(
    methods: Sequence[str], repeat: int, run: Callable[[str], dict[str, Any]], *, lenient: bool = False,
    line: Callable[[Mapping[str, Any]], str] = progress,
) -> dict[str, list[dict[str, Any]]]:
    """Every run of each method: ``repeat`` rounds, each running every method once (``run(method)``)
    so that the machine's drift hits them alike; a line on stderr per run. ``lenient``: a method whose
    run fails (RuntimeError) is reported and left out, else the failure ends the benchmark."""
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in methods}
    width = max(map(len, methods), default=0)
    for r in range(repeat):
        for method in list(runs):
            try:
                result = run(method)
            except RuntimeError as e:
                if not lenient:
                    raise
                print(f"  {method} left out: {e}", file=sys.stderr, flush=True)
                del runs[method]
                continue
            runs[method].append(result)
            print(f"  round {r + 1}/{repeat} {method:{width}s} {line(result)}", file=sys.stderr, flush=True)
    return runs


def summarize(runs: Sequence[Mapping[str, Any]], keys: Iterable[str] = ()) -> dict[str, Any]:
    """The run of median time, with the median of ``seconds``, ``cpu_seconds`` and each of ``keys``
    over all runs, and every run's times (``all_seconds``, ``all_cpu_seconds``)."""
    out = dict(sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2])
    for key in ("seconds", "cpu_seconds", *keys):
        out[key] = statistics.median(r[key] for r in runs)
    out["all_seconds"] = [round(r["seconds"], 3) for r in runs]
    out["all_cpu_seconds"] = [round(r["cpu_seconds"], 3) for r in runs]
    return out


# --- what a report prints -------------------------------------------------------------------------


def load_line() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def machine_line() -> str:
    import psutil

    mem = psutil.virtual_memory().total / GIB
    return f"machine: {os.cpu_count()} CPUs, {mem:.1f} GiB RAM, {load_line()}"


def table(columns: Sequence[str], rows: Iterable[Sequence[object]], left: int = 1) -> str:
    """A Markdown table: the first ``left`` columns aligned left, the others right (no ``rows``: its
    head, for a table printed row by row with :func:`row`)."""
    align = "|" + "|".join("---" if i < left else "---:" for i in range(len(columns))) + "|"
    return "\n".join([row(columns), align, *map(row, rows)])


def row(cells: Sequence[object]) -> str:
    """One row of a Markdown table."""
    return "| " + " | ".join(map(str, cells)) + " |"


def runs_cell(values: Sequence[float]) -> str:
    """Every run's figure, as a table cell lists them."""
    return ", ".join(f"{v:.2f}" for v in values)


def speed_cell(base: Mapping[str, Any] | None, result: Mapping[str, Any]) -> str:
    """How many times as fast as ``base`` ``result`` was, in wall and CPU seconds (empty without one)."""
    if base is None:
        return ""
    return f"{base['seconds'] / result['seconds']:.2f}×, {base['cpu_seconds'] / result['cpu_seconds']:.2f}×"


# --- checkpoints ----------------------------------------------------------------------------------


def safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """A safetensors file's header (its ``__metadata__`` left out) and the offset of its data section."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def checkpoint_line(directory: Path) -> str:
    """Where a checkpoint is, its size and files, and the config fields that give its shape."""
    config = json.loads((directory / "config.json").read_text())
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_local_experts", "vocab_size")
    shape = ", ".join(f"{k}={config[k]}" for k in keys if k in config)
    files = len(list(directory.glob("*.safetensors")))
    return f"{directory}: {tensor_bytes(directory) / GIB:.3f} GiB in {files} files ({shape})"


def tensor_bytes(directory: Path) -> int:
    """Bytes of the safetensors files of ``directory``."""
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))
