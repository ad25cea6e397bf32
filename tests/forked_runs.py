"""One-process script runs for the tests, forked from a server that has imported the training stack once.

A tiny one-process run on the 2-core CI machine spends about 4 of its ~7 s importing torch, transformers, datasets,
accelerate, deepspeed and peft. Here a multiprocessing fork server imports them once per pytest worker (the recipes'
own import statements, gpu_suite/preload.py, plus what the recipes import inside functions), and each run is a fork
of it that executes the script as `__main__` with the caller's argv, environment and working directory, its stdout and
stderr captured apart, its exit status as `python script.py` would give it (atexit handlers run, an uncaught exception
prints its traceback and exits 1), and a timeout. Runs under a launcher (`accelerate launch`), or with an environment
that must be read at import time, stay ordinary subprocesses (conftest.run_script decides).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Imported inside the recipes' functions, ~2 s a run: get_scheduler (transformers.optimization imports peft, which
# imports bitsandbytes), accelerate's unwrap_model (deepspeed, told the CPU accelerator by DS_ACCELERATOR).
PRELOAD = ["gpu_suite.preload", "transformers.optimization", "deepspeed", "peft", __name__.rpartition(".")[2]]

_context = None


def _server():
    global _context
    if _context is None:
        from multiprocessing import forkserver

        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        # The server finds common/, gpu_suite/ and this module through PYTHONPATH, set for its start only.
        before = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.dirname(__file__)] + ([before] if before else []))
        try:
            forkserver.ensure_running()
        finally:
            if before is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = before
    return _context


def _exit_status(code) -> int:
    """What the interpreter does with `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_in_child(cmd: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str) -> None:
    for fd, path in ((1, out_path), (2, err_path)):
        handle = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = list(cmd)
    sys.path[0] = os.path.dirname(os.path.abspath(cmd[0]))  # as `python script.py` sets it
    try:
        runpy.run_path(cmd[0], run_name="__main__")
        status = 0
    except SystemExit as e:
        status = _exit_status(e.code)
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        status = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def forkable(script: str) -> bool:
    """A script of this checkout (the server has imported its common/; a copy elsewhere must import its own), unless
    TEST_FORKED_RUNS=0 asks for plain subprocesses."""
    inside = os.path.commonpath([ROOT, os.path.abspath(script)]) == ROOT
    return inside and os.environ.get("TEST_FORKED_RUNS", "1") != "0"


def run_forked(cmd: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`,
    forked from the preloaded server."""
    context = _server()
    with tempfile.TemporaryDirectory(prefix="forked-run-") as d:
        out_path, err_path = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        process = context.Process(target=_run_in_child, args=(cmd, cwd, env, out_path, err_path))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired([sys.executable, *cmd], timeout)
        with open(out_path, encoding="utf-8", errors="replace") as f:
            stdout = f.read()
        with open(err_path, encoding="utf-8", errors="replace") as f:
            stderr = f.read()
    return subprocess.CompletedProcess([sys.executable, *cmd], process.exitcode, stdout, stderr)
