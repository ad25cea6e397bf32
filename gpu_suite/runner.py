"""How the suite starts a training script: a subprocess, or a process forked from a preloaded server.

Importing torch, transformers, datasets and accelerate takes ~6 s of a ~8 s tiny CPU run, so a suite of twenty
short runs spends most of its time importing. With `prefork`, a multiprocessing fork server imports once what the
recipes import (gpu_suite/preload.py; a recipe itself is never imported) and every run is a fork of it that executes
the script as `__main__` (runpy), with the same argv, working directory and exit status as
`python scripts/<script>.py ...`. The server never touches CUDA, but forking a process that has loaded CUDA
libraries is a risk not worth taking on an untested GPU machine: the suite uses it on CPUs only unless told otherwise.
Launcher commands (`accelerate launch ...`) always run as subprocesses.
"""

from __future__ import annotations

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pin_to(core: int | None) -> None:
    """Keep this process (and what it starts) on one core: the scripts then use one thread (common.runtime's
    use_all_cores counts usable cores), and two threads cannot stall each other on a CPU shared with other work."""
    if core is not None:
        os.sched_setaffinity(0, {core})


def run_script_in_child(script: str, argv: list[str], log_path: str, cwd: str, core: int | None) -> None:
    """The body of a forked run: output to `log_path`, then the script as `__main__` (SystemExit -> exit status)."""
    pin_to(core)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def start_fork_server(paths: list[str]) -> None:
    """Start multiprocessing's fork server (idempotent). Python 3.11's fork server does not take the parent's sys.path:
    it finds its preloaded modules through PYTHONPATH, here `paths` first, set for its start only (the caller's
    subprocesses keep the caller's)."""
    from multiprocessing import forkserver

    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + ([before] if before else []))
    try:
        forkserver.ensure_running()
    finally:
        if before is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = before


class Runner:
    """Runs commands with their output in a log file and a timeout; exit status, or None when stopped at the timeout."""

    def __init__(self, prefork: bool, cwd: str) -> None:
        self.cwd = cwd
        self.context = None
        if prefork:
            self.context = multiprocessing.get_context("forkserver")
            # this module: each fork unpickles its target from it
            self.context.set_forkserver_preload(["gpu_suite.preload", __name__])

    def start(self) -> None:
        """Start the fork server (now: its imports overlap with the suite's own preparation; idempotent)."""
        if self.context is not None:
            start_fork_server([ROOT])

    def close(self) -> None:
        """Stop the fork server and reap it (its runs' CPU time then counts in the suite's own)."""
        if self.context is not None:
            from multiprocessing import forkserver

            stop = getattr(forkserver._forkserver, "_stop", None)  # private, but in every Python since 3.8
            if stop is not None:
                stop()

    def run(self, cmd: list[str], log_path: str, timeout: float, core: int | None = None) -> int | None:
        """`core`: pin the run to that CPU core (None: no pinning)."""
        forkable = self.context is not None and cmd[0] == sys.executable and cmd[1].endswith(".py")
        if forkable:
            return self._run_forked(cmd[1], cmd[2:], log_path, timeout, core)
        with open(log_path, "w", encoding="utf-8") as log:
            proc = subprocess.Popen(cmd, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=None if core is None else lambda: pin_to(core))
            try:
                return proc.wait(timeout=max(timeout, 0.1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the workers it started
                proc.wait()
                return None

    def _run_forked(self, script: str, argv: list[str], log_path: str, timeout: float, core: int | None) -> int | None:
        self.start()
        process = self.context.Process(target=run_script_in_child, args=(script, argv, log_path, self.cwd, core))
        process.start()
        process.join(max(timeout, 0.1))
        if process.is_alive():
            process.kill()
            process.join()
            return None
        return process.exitcode
