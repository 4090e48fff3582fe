"""Fresh processes for the tests' command lines, without each one paying Python's start-up and imports.

A server (``python -m tests.forked``: one per test process and import-time environment, started on
first use) imports numpy, JAX, Flax, otfload, torch, transformers and lm_eval once, starting no JAX
backend, then forks one child per command: ``[python, -m, MODULE, ...]``, ``[python, -c, CODE, ...]``
or a script installed next to the interpreter (``otfload``). As far as a test can tell the child is
the fresh process ``subprocess`` would start: its own environment, working directory, ``sys.argv``,
``sys.path``, standard streams, process group and exit status; its own JAX backend (``XLA_FLAGS``,
hence the device count, is read when it starts one), compilation caches and module state; it exits as
the interpreter does (threads joined, ``atexit`` handlers run, streams flushed), less the modules'
teardown. What it shares with its siblings is the imported code, copy-on-write, once lm_eval's command
line has been asked for, the index of lm_eval's built-in task files (:func:`_index_built_in_tasks`), and
torch's environment report that lm_eval adds to its results (:func:`_share_environment_report`).

Variables a library reads when it is imported (``JAX_*``, ``TQDM_*``, ``HF_*``, ...) are the
server's: a command whose environment differs from a server's in any variable but those read later
(:data:`LATE`, :data:`LATE_PREFIXES`) gets a server of its own.

:func:`run` stands for :func:`subprocess.run` and :class:`Process` for :class:`subprocess.Popen`,
as far as the tests use them (text output captured, or stderr merged into stdout; ``timeout``;
``communicate``, ``wait``, ``kill``, ``returncode``).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import types
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "optax", "otfload", "otfload.cli", "otfload.lm_eval", "torch",
           "transformers", "lm_eval", "lm_eval.tasks", "lm_eval.models.huggingface")  # fmt: skip
# Read when used, not when imported: a child sets them in its own environment. TORCHINDUCTOR_CACHE_DIR and
# KMP_DUPLICATE_LIB_OK are set in the test process by the libraries as they run (torch's compiler, scikit-learn).
LATE = frozenset({"XLA_FLAGS", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK",
                  "PWD", "OLDPWD", "_"})  # fmt: skip
# otfload.options.environment reads its settings at each call; pytest's own change from test to test
LATE_PREFIXES = ("OTFLOAD_", "PYTEST_")
POLL_S = 0.02
_subprocess_run = subprocess.run
# In a server and its children: the import-time variables it started with, and the installation's own
# entries of its sys.path (its first one and $PYTHONPATH's left out).
_IMPORTED_WITH: frozenset[tuple[str, str]] | None = None
_SERVER_PATH: list[str] = []
_SET_BY_IMPORTS: dict[str, str] = {}  # what the imports set in os.environ (as in a fresh process)


# --- the server, and the child it forks ----------------------------------------------------------


def _lm_eval_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is lm_eval's command line (``python -m lm_eval`` or ``-m otfload.lm_eval``)."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1:3] in (["-m", "lm_eval"], ["-m", "otfload.lm_eval"])


def _index_built_in_tasks() -> None:
    """lm_eval's command line indexes each of lm_eval's ~14k built-in task files (``TaskManager``, ~8 CPU-s) in
    every process it starts: in a server, index them once, before forking the first such command, and let each
    child's first index that starts with them take these entries (the same ones: the installed files do not
    change while the tests run), adding the other paths' as ``TaskIndex.build`` does. Any later index in
    the child is built as usual."""
    from lm_eval.tasks import _index, manager

    original: Any = _index.TaskIndex.build  # lm_eval is untyped
    if getattr(original, "built_in", None) is not None:  # done already
        return
    root = Path(manager.__file__).parent  # the directory TaskManager(include_defaults=True) indexes first
    built_in = original([root])

    def build(paths: Any, *, resolve_includes: bool = True) -> dict[str, Any]:
        paths = list(paths)
        if not (resolve_includes and paths and Path(paths[0]) == root):
            built: dict[str, Any] = original(paths, resolve_includes=resolve_includes)
            return built
        _index.TaskIndex.build = staticmethod(original)  # once per child
        index = dict(built_in)
        for name, entry in original(paths[1:]).items():
            if name in index:
                _index.log.warning("Task '%s' from %s overrides existing task from %s", name, entry.yaml_path,
                                   index[name].yaml_path)  # fmt: skip
            index[name] = entry
        return index

    build.built_in = built_in  # type: ignore[attr-defined]
    _index.TaskIndex.build = staticmethod(build)
    gc.freeze()  # the new entries too: left alone by the children's collections


def _share_environment_report(directory: Path) -> None:
    """lm_eval puts torch's environment report (``torch.utils.collect_env.get_pretty_env_info``: a dozen
    commands, ``python -m pip list`` among them, ~1.2 CPU-s and seconds of wall) in every evaluation's
    results: in a server's children the first report is written into ``directory`` and every later one
    reads it (the same report: the installation and the machine do not change while the tests run)."""
    if "torch" not in sys.modules:  # a venv without torch: lm_eval reports none
        return
    from torch.utils import collect_env

    original = collect_env.get_pretty_env_info
    path = directory / "pretty_env_info"

    def get_pretty_env_info() -> str:
        with contextlib.suppress(FileNotFoundError):
            return path.read_text()
        report = original()
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(report)
        partial.replace(path)  # whole or absent for a sibling reading it meanwhile
        return report

    collect_env.get_pretty_env_info = get_pretty_env_info


def _python_command(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is ``python -m/-c ...`` or a script installed next to the interpreter."""
    if argv and argv[0] != sys.executable:
        return Path(argv[0]).parent == Path(sys.executable).parent
    return len(argv) >= 3 and argv[1] in ("-m", "-c")


def import_time_variables(env: Mapping[str, str]) -> frozenset[tuple[str, str]]:
    """The variables of ``env`` that an import may have read: a server's key."""
    return frozenset((k, v) for k, v in env.items() if k not in LATE and not k.startswith(LATE_PREFIXES))


def _pythonpath(env: Mapping[str, str]) -> list[str]:
    return [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _child(request: dict[str, Any]) -> NoReturn:
    """Become the command of ``request``, then exit as the interpreter does after ``python ...``:
    non-daemon threads joined, ``atexit`` handlers run, standard streams flushed, then ``os._exit``
    (the modules' teardown is skipped: a fresh process has little to tear down, a fork would copy
    every page of the server's objects to do it)."""
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in _SET_BY_IMPORTS.items():
        os.environ.setdefault(key, value)
    atexit._clear()  # the forking process's exit handlers and finalizers are not this one's to run
    for finalizer in list(weakref.finalize._registry):  # type: ignore[attr-defined]
        finalizer.detach()
    weakref.finalize._registered_with_atexit = False  # type: ignore[attr-defined]  # the command's register anew
    if "fds" in request:  # the command's stdin, stdout and stderr, open in this process already
        fds = request["fds"]
    else:
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = out if request["stderr"] is None else os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        fds = [os.open(os.devnull, os.O_RDONLY), out, err]
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds):
        os.close(fd)
    kind, target, *args = request["argv"][1:] if request["argv"][0] == sys.executable else ["script", *request["argv"]]
    first = {"-m": request["cwd"], "-c": ""}.get(kind, str(Path(target).parent))
    sys.path[:] = [first, *_pythonpath(request["env"]), *_SERVER_PATH]  # as a fresh interpreter builds it
    subprocess.run = _run_here  # type: ignore[assignment]  # its own python commands fork from it in turn
    code = 0
    try:
        if kind == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        elif kind == "-c":
            sys.argv = ["-c", *args]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec", dont_inherit=True), main.__dict__)  # not this file's __future__
        else:
            sys.argv = [target, *args]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except BaseException as e:  # as the interpreter reports an uncaught exception
        sys.excepthook(type(e), e, e.__traceback__)
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    _leave_distributed_job()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def _leave_distributed_job() -> None:
    """What an interpreter's teardown does for a ``jax.distributed`` job, which ``os._exit`` skips: its
    client's destructor shuts it down, a barrier with the job's other processes (process 0's exit would
    otherwise take the coordination service away from a process still in the job, which then aborts).
    A failure is left unreported, as a destructor's is."""
    from jax._src import distributed

    with contextlib.suppress(Exception):
        distributed.shutdown()


def become(request: dict[str, Any]) -> NoReturn:
    """In a process just forked: :func:`_child`, which ends it; a failure before the command runs
    (a working directory that does not exist, ...) ends it too, never returns into the forking code."""
    try:
        _child(request)
    except BaseException:
        traceback.print_exc()
    os._exit(1)


def _exit_code(code: object) -> int:
    """The exit status of ``SystemExit(code)``: 0 for None, the number, else 1 with ``code`` printed."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _wait(pid: int, timeout: float | None) -> int | None:
    """``pid``'s exit status as ``subprocess`` gives it (minus the signal that ended it), or None if
    it still runs after ``timeout`` seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, 0 if deadline is None else os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() >= deadline:  # type: ignore[operator]
            return None
        time.sleep(POLL_S)


def _kill(pid: int) -> None:
    """SIGKILL to a child and its process group (which it has not made yet if it has just started)."""
    for kill in (os.kill, os.killpg):
        with contextlib.suppress(ProcessLookupError):  # already gone
            kill(pid, signal.SIGKILL)


def _run_here(cmd: Any, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` in a server's child: a python command (:func:`_python_command`) whose output
    is captured forks from this very process, which holds the server's imports, as long as no JAX
    backend and no second thread has started here and its import-time variables are this process's;
    any other command is ``subprocess.run``'s."""
    from jax._src import xla_bridge

    argv = None if isinstance(cmd, str | bytes) else [os.fspath(c) for c in cmd]
    env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
    if (argv is None or not _python_command(argv) or not kwargs.get("capture_output")
            or set(kwargs) - {"capture_output", "text", "env", "cwd", "timeout", "check"}
            or import_time_variables(env) != _IMPORTED_WITH or threading.active_count() > 1
            or xla_bridge.backends_are_initialized()):  # fmt: skip
        return _subprocess_run(cmd, **kwargs)
    timeout = kwargs.get("timeout")
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = Path(tmp) / "out", Path(tmp) / "err"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            become({"argv": argv, "env": env, "cwd": os.fspath(kwargs.get("cwd") or os.getcwd()), "stdout": str(out),
                     "stderr": str(err)})  # fmt: skip
        code = _wait(pid, timeout)
        if code is None:
            _kill(pid)
            _wait(pid, None)
            raise subprocess.TimeoutExpired(argv, timeout or 0)
        stdout, stderr = out.read_bytes(), err.read_bytes()
    if kwargs.get("text"):
        stdout, stderr = stdout.decode(errors="replace"), stderr.decode(errors="replace")  # type: ignore[assignment]
    done = subprocess.CompletedProcess(argv, code, stdout, stderr)
    if kwargs.get("check"):
        done.check_returncode()
    return done


def serve() -> None:
    """The server: requests on stdin, replies on stdout, one JSON object a line."""
    requests, replies = os.fdopen(os.dup(0), "r"), os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # a stray print of the server's goes to its stderr, never into the replies
    before = dict(os.environ)
    for name in PRELOAD:
        with contextlib.suppress(ModuleNotFoundError):  # an optional library (lm_eval) not installed here
            importlib.import_module(name)
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError("importing the preloaded modules started a JAX backend: its children could not fork it")
    shared = tempfile.TemporaryDirectory(prefix="forked-server-")
    _share_environment_report(Path(shared.name))
    gc.freeze()  # the children's collections leave the server's objects alone (no page copied for them)
    global _IMPORTED_WITH, _SERVER_PATH, _SET_BY_IMPORTS
    _SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if before.get(k) != v}
    _IMPORTED_WITH = import_time_variables(os.environ)
    _SERVER_PATH = [p for p in sys.path[1:] if p not in _pythonpath(os.environ)]
    replies.write('{"ready": true}\n')
    replies.flush()
    for line in requests:
        request = json.loads(line)
        if request["op"] == "start":
            if _lm_eval_command(request["argv"]):
                _index_built_in_tasks()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                requests.close()
                replies.close()
                become(request)
            reply: dict[str, Any] = {"pid": pid}
        elif request["op"] == "wait":
            reply = {"returncode": _wait(request["pid"], request["timeout"])}
        else:  # "kill": the child's whole process group
            _kill(request["pid"])
            reply = {}
        replies.write(json.dumps(reply) + "\n")
        replies.flush()
    shared.cleanup()


# --- the client, in the test process ---------------------------------------------------------------


class _Server:
    """One server process and the pipe of requests to it."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115  (the server's stderr while it lives)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.forked"], cwd=ROOT, env=dict(env), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)  # fmt: skip
        if not self.proc.stdout.readline():  # type: ignore[union-attr]
            self.log.seek(0)
            raise RuntimeError(f"tests.forked's server did not start:\n{self.log.read().decode()[-4000:]}")

    def call(self, **request: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(request) + "\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"tests.forked's server ended:\n{self.log.read().decode()[-4000:]}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=30)
        self.log.close()


_SERVERS: dict[frozenset[tuple[str, str]], _Server] = {}


def _server(env: Mapping[str, str]) -> _Server:
    key = import_time_variables(env)
    if not _SERVERS:
        atexit.register(_close_servers)
    if key not in _SERVERS:
        _SERVERS[key] = _Server({**dict(key), "PYTHONPATH": str(ROOT)})
    return _SERVERS[key]


def _close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


class Process:
    """``cmd`` started as a fresh child of a server: a :class:`subprocess.Popen` with text output,
    stderr captured apart or (``merge``) into stdout."""

    def __init__(self, cmd: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, merge: bool = False) -> None:  # fmt: skip
        argv = [os.fspath(c) for c in cmd]
        if not _python_command(argv):
            raise ValueError(f"tests.forked runs python -m/-c or an installed script, not {argv[:3]}")
        self.args, self.returncode = argv, None
        env = dict(os.environ if env is None else env)
        self._dir = tempfile.TemporaryDirectory(prefix="forked-")
        self._out, self._err = Path(self._dir.name) / "out", None if merge else Path(self._dir.name) / "err"
        self._server = _server(env)
        request = {"argv": argv, "env": env, "cwd": os.fspath(cwd or os.getcwd()), "stdout": str(self._out),
                   "stderr": self._err and str(self._err)}  # fmt: skip
        self.pid: int = self._server.call(op="start", **request)["pid"]

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.call(op="wait", pid=self.pid, timeout=timeout)["returncode"]
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._server.call(op="kill", pid=self.pid)

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Wait for the exit (``TimeoutExpired`` past ``timeout``); ``(stdout, stderr)``, stderr None if merged."""
        self.wait(timeout)
        out = self._out.read_text(errors="replace")
        err = None if self._err is None else self._err.read_text(errors="replace")
        self._dir.cleanup()
        return out, err


def run(cmd: Sequence[str | os.PathLike[str]], *, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None, timeout: float | None = None, check: bool = False,
        capture_output: bool = True, text: bool = True) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """:func:`subprocess.run` of ``cmd`` in a forked child, its output always captured as text (the
    two flags are accepted for a call written for ``subprocess.run``); past ``timeout`` the child's
    process group is killed and ``TimeoutExpired`` raised."""
    if not (capture_output and text):
        raise ValueError("tests.forked.run captures the output, as text")
    proc = Process(cmd, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.wait(), out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve()
