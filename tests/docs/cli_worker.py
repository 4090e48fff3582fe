"""Run the docs pages' ``otfload`` commands inside one long-lived process instead of one process each.

Each ``otfload ...`` a page's bash block runs costs a fresh interpreter 3-10 s of CPU (Python, JAX, lm_eval
imports and compiling the same tiny programs again) for a second of work. Here the bash blocks still run in
bash, as written (pipes, redirections, ``$(...)``, ``&``), but the ``otfload`` they find first on PATH is a
small stdlib-only client (``SHIM``) that hands its arguments, working directory, environment and its own
stdin/stdout/stderr descriptors (SCM_RIGHTS) to the process that runs the block (``Worker.run_bash``), which
runs ``otfload.cli.main(argv)`` with those descriptors on its fds 0-2, that environment and that directory,
and sends the exit code back for the client to exit with. What the command prints therefore goes where the
shell sent it, byte for byte, and the shell sees the command's exit status.

A command that joins a ``jax.distributed`` job (``--coordinator``) needs a process of its own: the client
hands it to a process forked when the worker starts (before any command: no JAX backend, one thread), which
forks a fresh process for it that runs the real console script (``tests.forked``: its imports done once), so
the page's multi-process jobs stay processes of their own. A command whose environment differs from the
worker's in a variable an import reads, not only ``PATH`` and bash's ``SHLVL``, or given to a worker made in
a process with threads or a JAX backend (which cannot fork safely), becomes the console script itself.

State a command leaves in the process is put back afterwards: ``os.environ``, the working directory,
``sys.argv``, the SIGINT handler, the descriptors 0-2 and ``sys.stdin``/``stdout``/``stderr``. JAX's backend
(devices already initialised) and its in-memory compilation caches are shared by the commands, which is the
point.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

from jax._src import xla_bridge

from tests import forked

ADDRESS = "OTFLOAD_CLI_WORKER"  # the variable that gives the client the worker's socket
CONSOLE_SCRIPT = Path(sys.executable).with_name("otfload")
# fds 0-2 as a fresh interpreter opens them: stdin, stdout (block-buffered off a terminal), stderr (line-buffered)
STREAMS = ((0, "r", -1, "strict"), (1, "w", -1, "strict"), (2, "w", 1, "backslashreplace"))
SHIM = '''#!{python} -IS
"""otfload, as the docs test runs it: the command runs in the test's worker process (tests/docs/cli_worker.py)."""
import json, os, socket, sys
fresh = "--coordinator" in sys.argv  # one process of a jax.distributed job: a process of its own
address = os.environ["{address}"] + ("-fresh" if fresh else "")
if fresh and not os.path.exists(address):  # a worker that cannot fork one: the console script itself
    os.execv({script!r}, [{script!r}, *sys.argv[1:]])
request = json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
with socket.socket(socket.AF_UNIX) as worker:
    worker.connect(address)
    socket.send_fds(worker, [b"."], [0, 1, 2])
    worker.sendall(request)
    worker.shutdown(socket.SHUT_WR)
    reply = worker.recv(16)
if not reply:
    sys.exit("otfload (docs test shim): the worker process ended without an exit code")
sys.exit(int(reply))
'''


def exit_code(error: SystemExit) -> int:
    """The status a process ending with ``error`` exits with (``sys.exit("message")``: printed, 1)."""
    if error.code is None or isinstance(error.code, int):
        return error.code or 0
    print(error.code, file=sys.stderr)
    return 1


def flush_standard_streams() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a reader gone (``| head``) has nothing left to take
            stream.flush()


@contextlib.contextmanager
def command_context(env: Mapping[str, str], cwd: str, fds: Sequence[int]) -> Iterator[None]:
    """``fds`` on 0, 1, 2, ``env`` as ``os.environ`` and ``cwd`` as the working directory, all put back after."""
    saved_env, saved_cwd, saved_argv = dict(os.environ), os.getcwd(), sys.argv
    saved_sigint = signal.getsignal(signal.SIGINT)
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    flush_standard_streams()
    saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
    streams: tuple[IO[Any], ...] = ()
    try:
        for fd, target in enumerate(fds):
            os.dup2(target, fd)
        # streams of their own on fds 0-2, as a fresh interpreter's (pytest's capture replaces sys.stdout)
        streams = tuple(
            open(fd, mode, buffering, errors=errors, closefd=False)  # noqa: SIM115  (closed in the finally below)
            for fd, mode, buffering, errors in STREAMS
        )
        sys.stdin, sys.stdout, sys.stderr = streams
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        yield
    finally:
        flush_standard_streams()
        sys.stdin, sys.stdout, sys.stderr = saved_streams
        for stream in streams:
            with contextlib.suppress(Exception):  # flushed above: closing drops a broken pipe's leftovers
                stream.close()
        for fd, saved in enumerate(saved_fds):
            os.dup2(saved, fd)
            os.close(saved)
        os.environ.clear()
        os.environ.update(saved_env)
        os.chdir(saved_cwd)
        sys.argv = saved_argv
        signal.signal(signal.SIGINT, saved_sigint)


def receive(connection: socket.socket) -> tuple[list[int], dict[str, Any]]:
    """A client's descriptors 0-2 and its request (``argv``, ``cwd``, ``env``)."""
    _, fds, _, _ = socket.recv_fds(connection, 1, 3)
    chunks = []
    while chunk := connection.recv(1 << 16):
        chunks.append(chunk)
    return fds, json.loads(b"".join(chunks))


def run_fresh(connection: socket.socket) -> NoReturn:
    """In a child of the fresh processes' parent: one client's command in a fresh process forked from this
    one, running the real console script (:func:`tests.forked.become`), or the console script itself when
    the command's environment is not this process's at import time; its exit code sent back."""
    fds, request = receive(connection)
    argv, env = [str(CONSOLE_SCRIPT), *request["argv"]], request["env"]
    changed = forked.import_time_variables(env) ^ forked.import_time_variables(os.environ)
    pid = os.fork()
    if pid == 0:
        if {name for name, _ in changed} <= {"PATH", "SHLVL"}:
            forked.become({"argv": argv, "env": env, "cwd": request["cwd"], "fds": fds})
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.chdir(request["cwd"])
        os.execve(argv[0], argv, env)
    for fd in fds:
        os.close(fd)
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    with contextlib.suppress(OSError):  # a client killed meanwhile
        connection.sendall(str(status if status >= 0 else 128 - status).encode())  # as bash reports a signal
    os._exit(0)


def serve_fresh(listener: socket.socket) -> NoReturn:
    """The fresh processes' parent, forked before any command ran: a child for each client (:func:`run_fresh`),
    until the worker kills it."""
    while True:
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            run_fresh(connection)
        connection.close()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:  # the clients' children that have ended
                pass


def run_command(argv: list[str], env: Mapping[str, str], cwd: str, fds: Sequence[int]) -> int:
    """``otfload ARGV`` as the console script would run it, in this process; its exit code."""
    from otfload.cli import main

    with command_context(env, cwd, fds):
        sys.argv = [str(CONSOLE_SCRIPT), *argv]
        try:
            return main(argv)
        except SystemExit as e:  # argparse's usage errors and --help/--version
            return exit_code(e)
        except BaseException:  # what the console script would die of: its traceback on its stderr
            traceback.print_exc()
            return 1


def serve(connection: socket.socket) -> None:
    """One client's request: run it and answer its exit code."""
    with connection:
        fds, request = receive(connection)
        try:
            code = run_command(request["argv"], request["env"], request["cwd"], fds)
        finally:
            for fd in fds:
                os.close(fd)
        with contextlib.suppress(OSError):  # a client killed meanwhile
            connection.sendall(str(code).encode())


class Worker:
    """The listening socket and the ``otfload`` client on PATH; :meth:`run_bash` runs a block with them."""

    def __init__(self) -> None:
        self.directory = tempfile.TemporaryDirectory(prefix="otfload-cli-worker-")
        root = Path(self.directory.name)
        (root / "bin").mkdir()
        shim = root / "bin" / "otfload"
        shim.write_text(SHIM.format(python=sys.executable, script=str(CONSOLE_SCRIPT), address=ADDRESS))
        shim.chmod(0o755)
        self.address = str(root / "socket")
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(self.address)
        self.listener.listen(8)
        self.fresh = None  # the fresh processes' parent: forked only from a process that can fork safely
        if threading.active_count() == 1 and not xla_bridge.backends_are_initialized():
            with socket.socket(socket.AF_UNIX) as fresh:
                fresh.bind(f"{self.address}-fresh")
                fresh.listen(8)
                self.fresh = os.fork()
                if self.fresh == 0:
                    self.listener.close()
                    serve_fresh(fresh)

    def close(self) -> None:
        if self.fresh is not None:
            os.kill(self.fresh, signal.SIGKILL)
            os.waitpid(self.fresh, 0)
        self.listener.close()
        self.directory.cleanup()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def environment(self) -> dict[str, str]:
        """This process's environment with the client first on PATH and the socket's address."""
        path = f"{Path(self.directory.name) / 'bin'}{os.pathsep}{os.environ['PATH']}"
        return {**os.environ, "PATH": path, ADDRESS: self.address}

    def run_bash(self, block: str, *, stdout: int | IO[str] | None) -> None:
        """``bash -euo pipefail -c BLOCK``, serving its ``otfload`` commands until bash ends; a block that
        fails raises ``subprocess.CalledProcessError``, as ``subprocess.run(..., check=True)``."""
        command = ["bash", "-euo", "pipefail", "-c", block]
        with (
            subprocess.Popen(command, env=self.environment(), stdout=stdout) as shell,
            selectors.DefaultSelector() as selector,
        ):
            ended = os.pidfd_open(shell.pid)
            try:
                selector.register(self.listener, selectors.EVENT_READ)
                selector.register(ended, selectors.EVENT_READ)
                while shell.poll() is None:
                    for key, _ in selector.select():
                        if key.fileobj is self.listener:
                            serve(self.listener.accept()[0])
            finally:
                os.close(ended)
        if shell.returncode:
            raise subprocess.CalledProcessError(shell.returncode, command)
