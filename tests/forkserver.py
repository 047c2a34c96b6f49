"""``kvscope`` commands of the tests and the pages, each a process of its own forked from one that
has already imported what the command line needs: a command costs its work, not ~2–5 s of
starting Python and importing torch, transformers, kvpress, xarray and dask again (the suite runs
~150 of them).

    server   python -m tests.forkserver SOCKET      imports PRELOAD, then serves SOCKET
    client   FOLDER/bin/kvscope ARGS …              first on the pages' PATH; ``run_cli``'s command

For each command the client sends its arguments, working folder and environment, and its
standard input, output and error (the file descriptors themselves); the server forks a reporter,
which forks the command's process: it takes those descriptors, ``sys.argv``, ``os.environ`` and
``sys.path`` as the console script would have them (PYTHONPATH included), runs
``kvscope.cli.main`` and ends as the interpreter ends it — an uncaught exception printed with exit
1, non-daemon threads joined, atexit functions run, output flushed — less tearing down the
preloaded modules. The reporter sends the wait status back and the client exits with it (or
its signal). Where the server cannot be reached, the client runs the console script itself.

What this changes against a fresh interpreter: the modules of PRELOAD are already in
``sys.modules`` (commands' import cost is measured elsewhere: benchmarks/cli_startup.py and
tests/test_cli.py's lazy-import test start Python afresh), and a variable that a preloaded
library reads once at import (``OMP_NUM_THREADS``, ``HF_HOME``) has the value the server started
with: ``run_cli`` with variables of its own starts a fresh interpreter. tests/test_docs.py checks
that a served command prints and exits as the console script does.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path

PRELOAD = [
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "kvpress",
    "numpy",
    "xarray",
    "zarr",
    "dask.array",
    "scipy.optimize",
    "matplotlib.pyplot",
    "kvscope.cli",
    "kvscope.analysis",
    "kvscope.replay",
    "kvscope.tracing.runner",
    "kvscope.live.run",
]
HEADER = 8  # bytes: the length of the JSON request that follows

CLIENT = """#!{python} -SE
import json, os, socket, sys
request = json.dumps({{"mode": {mode!r}, "argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode()
request = len(request).to_bytes({header}, "big") + request
try:
    s = socket.socket(socket.AF_UNIX)
    s.connect({socket!r})
    sent = socket.send_fds(s, [request], [0, 1, 2])
    s.sendall(request[sent:])
    status = s.recv(4)
except OSError:
    status = b""
if len(status) != 4:  # no server: a fresh interpreter
    os.execv({fallback!r}, [{fallback!r}, *sys.argv[1:]])
code = os.waitstatus_to_exitcode(int.from_bytes(status, "big"))
if code < 0:
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


_SERVER: dict = {}  # this process's server: "process", "folder"


def enabled() -> bool:
    """``KVSCOPE_TEST_FORKSERVER=0``: every command a fresh console script."""
    return os.environ.get("KVSCOPE_TEST_FORKSERVER") != "0"


def client(mode: str = "kvscope") -> Path:
    """The client of this process's server (started on first use with this process's environment,
    stopped when the process exits): ``kvscope`` runs ``kvscope ARGS``, ``python`` runs ``python
    SCRIPT ARGS``."""
    if "folder" not in _SERVER:
        folder = Path(tempfile.mkdtemp(prefix="kvscope-forkserver-"))
        _SERVER["process"], _SERVER["folder"] = start(folder, dict(os.environ)), folder
        atexit.register(stop, _SERVER["process"], folder)
    return _SERVER["folder"] / "bin" / mode


def start(folder: Path, env: dict) -> subprocess.Popen:
    """A server started with ``env``, listening in ``folder``, and its clients in ``folder``/bin."""
    sock = folder / "kvscope.sock"
    (folder / "bin").mkdir(parents=True, exist_ok=True)
    for mode, fallback in (("kvscope", Path(sys.executable).parent / "kvscope"), ("python", Path(sys.executable))):
        path = folder / "bin" / mode
        path.write_text(CLIENT.format(python=sys.executable, mode=mode, header=HEADER, socket=str(sock),
                                      fallback=str(fallback)))  # fmt: skip
        path.chmod(0o755)
    root = Path(__file__).resolve().parents[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "tests.forkserver", str(sock)], cwd=root, env=env, stdout=subprocess.PIPE, text=True
    )
    if server.stdout.readline().strip() != "ready":
        server.kill()
        raise RuntimeError("the kvscope fork server did not start")
    return server


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:HEADER], "big")
    while len(data) < HEADER + size:
        data += conn.recv(1 << 16)
    return json.loads(data[HEADER:]), fds


def _run(request: dict, fds: list[int]) -> None:
    """The command, in the forked process: never returns."""
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # sys.stdin/stdout/stderr stay the objects the libraries already hold (empty): they now read and write the
    # client's descriptors
    extra = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if request["mode"] == "python":  # python SCRIPT ARGS: the script's folder first on sys.path, run as __main__
        script = Path(request["argv"][0]).resolve()
        sys.argv = list(request["argv"])
        sys.path[:1] = [str(script.parent), *extra]

        def main() -> None:
            runpy.run_path(str(script), run_name="__main__")
    else:  # the console script: its folder, then PYTHONPATH; its module as __main__ (what spawned processes re-run)
        script = Path(sys.executable).parent / "kvscope"
        sys.argv = [str(script), *request["argv"]]
        sys.path[:1] = [str(script.parent), *extra]
        main_module = types.ModuleType("__main__")
        main_module.__file__, main_module.__spec__ = str(script), None
        sys.modules["__main__"] = main_module
        from kvscope.cli import main

    try:
        code = main()
    except SystemExit as exc:
        code = exc.code
    except BaseException:  # noqa: BLE001 - printed and exit 1, as the interpreter ends an uncaught one
        sys.excepthook(*sys.exc_info())
        code = 1
    if not isinstance(code, int):  # sys.exit("message") / sys.exit(None), as Python ends them
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    threading._shutdown()  # what the interpreter does at exit, less tearing down the preloaded modules
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def serve(path: str) -> None:
    """Fork a reporter per request, which forks the command and sends its wait status back."""
    for name in PRELOAD:
        __import__(name)
    gc.freeze()  # the forked processes' collections leave the preloaded objects' pages shared
    parent = os.getppid()
    Path(path).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(path)
    listener.listen(64)
    listener.settimeout(5)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # reporters reaped by the kernel
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test worker is gone
                return
            continue
        conn.settimeout(None)
        request, fds = _receive(conn)
        if os.fork() == 0:
            listener.close()
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            pid = os.fork()
            if pid == 0:
                conn.close()
                _run(request, fds)
            for fd in fds:
                os.close(fd)
            _, status = os.waitpid(pid, 0)
            conn.sendall(status.to_bytes(4, "big"))
            os._exit(0)
        for fd in fds:
            os.close(fd)
        conn.close()


def stop(server: subprocess.Popen, folder: Path) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    serve(sys.argv[1])
