"""Test-wide setup: 8 simulated CPU devices, shared tiny-checkpoint fixtures and a descriptor-leak report.

XLA_FLAGS must be set before JAX initialises its backend, hence at import time here.
"""

import importlib.metadata
import os
import tempfile

# The tests compile hundreds of tiny programs and run each once or twice, so XLA's CPU compiler, not
# the programs, takes most of the suite's CPU (tests/models/test_padding.py: 46 of 78 s). Compiled
# with less effort (no LLVM optimisation passes, no fusion emitters) the same programs, sharding and
# all, compile 3-4x faster and give the same numbers within float rounding, which every reference
# check's tolerance already allows for.
# The XLA of jaxlib >= 0.12 (the MaxText venv's) no longer has the fusion-emitter flag, and an unknown flag
# in XLA_FLAGS is fatal there.
_JAXLIB = tuple(int(part) for part in importlib.metadata.version("jaxlib").split(".")[:2])
_FUSION = "" if _JAXLIB >= (0, 12) else " --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8" + _FUSION)
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_DISABLE_XET", "1")
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CLI eval jobs keep XLA's compile cache on by default (~/.cache/otfload/xla): the tests' go to a
# directory of this run instead, never into the user's cache.
os.environ.setdefault("OTFLOAD_COMPILE_CACHE", tempfile.mkdtemp(prefix="otfload-test-xla-"))

import contextlib  # noqa: E402
import gc  # noqa: E402

import pytest  # noqa: E402

from tests.helpers import save_tiny_hf_model  # noqa: E402

# Descriptors a test module may leave open: servers and the JAX backend start once per session (a
# listening socket, a few pipes) in whichever module first needs them. A module that leaves sources
# open holds one or more per file it read, so leaks of a few sources already pass this.
FD_GROWTH_PER_MODULE = 16
# Modules that left more open, with what the new descriptors point at: listed at the end of the run
# (a report, not a failure, until every module is clean: see the terminal summary hook below).
DESCRIPTOR_LEAKS: list[str] = []


def open_fds() -> dict[int, str]:
    """This process's open descriptors and what each points at."""
    fds = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            fds[int(name)] = os.readlink(f"/proc/self/fd/{name}")
    return fds


@pytest.fixture(scope="module", autouse=True)
def no_descriptor_leak(request):
    """Record a test module that leaves more than ``FD_GROWTH_PER_MODULE`` descriptors open (sources it
    opened and never closed) in ``DESCRIPTOR_LEAKS``, with what they point at."""
    if not os.path.isdir("/proc/self/fd"):
        yield
        return
    before = open_fds()
    yield
    if len(open_fds()) - len(before) > FD_GROWTH_PER_MODULE:
        gc.collect()  # only objects that close on collection; a plain descriptor stays counted
        after = open_fds()
        new = sorted(t for fd, t in after.items() if before.get(fd) != t)
        if len(after) - len(before) > FD_GROWTH_PER_MODULE:
            DESCRIPTOR_LEAKS.append(f"{request.module.__name__}: {len(after) - len(before)} more open: {new[:8]}")


def pytest_sessionfinish(session):
    """On a pytest-xdist worker (``-n``), hand ``DESCRIPTOR_LEAKS`` to the controller, which reports them."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["descriptor_leaks"] = DESCRIPTOR_LEAKS


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's controller: collect a finished worker's ``DESCRIPTOR_LEAKS``."""
    DESCRIPTOR_LEAKS.extend(getattr(node, "workeroutput", {}).get("descriptor_leaks", []))


def pytest_terminal_summary(terminalreporter):
    """List the modules that leaked descriptors (``DESCRIPTOR_LEAKS``)."""
    if DESCRIPTOR_LEAKS:
        terminalreporter.section(f"descriptor leaks (modules leaving > {FD_GROWTH_PER_MODULE} open)")
        for line in DESCRIPTOR_LEAKS:
            terminalreporter.write_line(line)


@pytest.fixture
def closing():
    """``closing(thing) -> thing``: ``thing.close()`` when the test ends (a source the test reads after use)."""
    with contextlib.ExitStack() as stack:
        yield lambda thing: stack.enter_context(contextlib.closing(thing))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """Build tiny HF checkpoints lazily, once per session: ``tiny_checkpoints(name) -> (dir, torch model)``."""
    cache: dict = {}
    root = tmp_path_factory.mktemp("hf")

    def get(name: str):
        if name not in cache:
            cache[name] = save_tiny_hf_model(name, root / name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def example_checkpoints(tmp_path_factory):
    """``otfload example``'s checkpoints (tiny Llama, LoRA adapter, FP8 copy), written once per session."""
    from otfload.examples import write_examples

    return write_examples(tmp_path_factory.mktemp("examples"))


@pytest.fixture(scope="session")
def mesh_2x4():
    from otfload.plan.sharding import make_mesh

    return make_mesh({"fsdp": 2, "tp": 4})


from tests.servers.fixtures import gcs_server, hub, hub_server  # noqa: E402,F401  (real Hub/GCS servers)
