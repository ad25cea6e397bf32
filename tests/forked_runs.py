"""Script runs for the tests, their processes forked from a server that has imported the training stack once.

A tiny one-process run on the 2-core CI machine spends about 4 of its ~7 s importing torch, transformers, datasets,
accelerate, deepspeed and peft. Here a multiprocessing fork server imports them once per pytest worker (the recipes'
own import statements, gpu_suite/preload.py, plus what the recipes import inside functions), and each run is a fork
of it that executes the script as `__main__` with the caller's argv, environment and working directory, its stdout and
stderr captured apart, its exit status as `python script.py` would give it (atexit handlers run, an uncaught exception
prints its traceback and exits 1), and a timeout.

`launch_forked` does the same for `accelerate launch --config_file ... script`: accelerate's own launch code turns the
flags and the config file into the processes' environment (as `accelerate launch` does), torchrun's per-process
variables are added (ranks, world size, the rendezvous address), and each process is a fork. It stands in for the
launcher's process management only, so conftest.run_script uses it unless the test reads what the launcher itself
prints or returns (by default a `check=False` run); several machines, or an environment that must be read at import
time, get the real launcher or a plain subprocess (TORCH_COMPILE_DISABLE excepted: a fork sets it from its own).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# gpu_suite/preload.py: the recipes' imports, what they import inside functions, then gc.freeze(); this module.
PRELOAD = ["gpu_suite.preload", __name__.rpartition(".")[2]]

_context = None


def _server():
    global _context
    if _context is None:
        from gpu_suite.runner import start_fork_server

        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        start_fork_server([ROOT, os.path.dirname(__file__)])  # it imports common/, gpu_suite/ and this module
    return _context


def _exit_status(code) -> int:
    """What the interpreter does with `SystemExit(code)`."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _run_in_child(cmd: list[str], cwd: str, env: dict[str, str], out_path: str, err_path: str,
                  new_session: bool = False) -> None:
    if new_session:  # as Popen(start_new_session=True): the run and what it starts are one process group
        os.setsid()
    for fd, path in ((1, out_path), (2, err_path)):
        flags = os.O_WRONLY | (os.O_APPEND if out_path == err_path else os.O_TRUNC)  # one log: appended to
        handle = os.open(path, flags)
        os.dup2(handle, fd)
        os.close(handle)
    os.environ.clear()
    os.environ.update(env)
    # torch reads TORCH_COMPILE_DISABLE when it imports dynamo's config, as the server did: set from the run's own
    import torch._dynamo.config

    torch._dynamo.config.disable = env.get("TORCH_COMPILE_DISABLE") == "1"
    if env.get("TORCH_LOGS"):  # read at torch's import too
        torch._logging._internal._init_logs()
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


def forkable(script: str, imports_this_checkout: bool = False) -> bool:
    """A script of this checkout, or one elsewhere that imports this checkout's common/ (the server has imported it; a
    copy with its own common/ must import that), unless TEST_FORKED_RUNS=0 asks for plain subprocesses."""
    inside = imports_this_checkout or os.path.commonpath([ROOT, os.path.abspath(script)]) == ROOT
    return inside and os.environ.get("TEST_FORKED_RUNS", "1") != "0"


def run_forked(cmd: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([sys.executable, *cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)`,
    forked from the preloaded server."""
    return _run_processes([sys.executable, *cmd], cmd, cwd, [env], timeout)


class ForkedProcess:
    """What a test that signals a run reads of `subprocess.Popen`: `pid`, `poll()`, `wait(timeout)`, `returncode`."""

    def __init__(self, process) -> None:
        self.process, self.pid = process, process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(str(self.pid), timeout)
        return self.process.exitcode


def start(cmd: list[str], cwd: str, log_path: str) -> subprocess.Popen | ForkedProcess:
    """`Popen(cmd, cwd=cwd, stdout=log, stderr=STDOUT, start_new_session=True)` with `log` opened for appending and
    this process's environment, for the tests that kill a one-process run: `python <script of this checkout>` is
    forked from the preloaded server (a SIGKILL ends a fork as it ends any process), anything else is a subprocess."""
    if cmd[0] == sys.executable and forkable(cmd[1]):
        open(log_path, "a").close()
        process = _server().Process(target=_run_in_child,
                                    args=(cmd[1:], cwd, dict(os.environ), log_path, log_path, True))
        process.start()
        return ForkedProcess(process)
    with open(log_path, "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_launched(cmd: list[str], cwd: str, log_path: str) -> list[ForkedProcess]:
    """`accelerate launch <flags> <script> <arguments>` (cmd) with each process forked, their output appended to
    `log_path`, not waited for: for the tests that kill a run of several processes (each one SIGKILLed)."""
    script, envs = launched_environments(cmd[2:], dict(os.environ))
    open(log_path, "a").close()
    processes = [_server().Process(target=_run_in_child, args=(script, cwd, env, log_path, log_path)) for env in envs]
    for process in processes:
        process.start()
    return [ForkedProcess(process) for process in processes]


def launched_environments(launch_args: list[str], env: dict[str, str]) -> tuple[list[str], list[dict[str, str]]] | None:
    """`accelerate launch <launch_args>` on this machine: the script and its arguments, and each process's
    environment; None where the real launcher must run (several machines, or a launcher other than torchrun's and the
    simple one)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    with mock.patch.dict(os.environ, env, clear=True):  # accelerate copies os.environ into what it returns
        args, defaults, mp_from_config_flag = _validate_launch_command(launch_command_parser().parse_args(launch_args))
        if args.module or args.no_python:
            return None
        script = [args.training_script, *args.training_script_args]
        if args.num_machines > 1 or args.cpu or args.tpu or args.use_megatron_lm:
            return None
        if args.use_deepspeed:  # as accelerate's launch_command hands it to deepspeed_launcher
            fields = list(defaults.deepspeed_config.keys()) if defaults else []
            args.deepspeed_fields_from_accelerate_config = ",".join(
                fields + (["mixed_precision"] if mp_from_config_flag else []))
            _, base = launch_utils.prepare_deepspeed_cmd_env(args)
        elif args.use_fsdp or args.multi_gpu:
            base = launch_utils.prepare_multi_gpu_env(args)
        else:
            _, base = launch_utils.prepare_simple_launcher_cmd_env(args)
            return script, [base]
    n = int(args.num_processes)
    torchrun = {  # what torchrun adds for every process of one machine
        "GROUP_RANK": "0", "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(n), "WORLD_SIZE": str(n),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(args.main_process_port), "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_USE_AGENT_STORE": "False",  # rank 0 hosts the store: there is no agent
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        **({"PYTORCH_NVML_BASED_CUDA_CHECK": "1"} if args.use_deepspeed else {}),  # as deepspeed's import sets it
        **({"OMP_NUM_THREADS": base.get("OMP_NUM_THREADS", "1")} if n > 1 else {})}
    return script, [{**base, **torchrun, "LOCAL_RANK": str(rank), "RANK": str(rank), "ROLE_RANK": str(rank)}
                    for rank in range(n)]


def launch_forked(cmd: list[str], cwd: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """`cmd` (`accelerate launch <flags> <script> <arguments>`) with each process forked; None where it must run as
    itself (`launched_environments`, or a script outside this checkout). Exit status 1 when a process failed (as the
    launcher's), after the others are stopped."""
    launched = launched_environments(cmd[2:], env)
    if launched is None or not forkable(launched[0][0]):
        return None
    script, envs = launched
    return _run_processes(cmd, script, cwd, envs, timeout)


def _run_processes(shown: list[str], cmd: list[str], cwd: str, envs: list[dict[str, str]],
                   timeout: float) -> subprocess.CompletedProcess:
    context = _server()
    with tempfile.TemporaryDirectory(prefix="forked-run-") as d:
        paths = [(os.path.join(d, f"{rank}.out"), os.path.join(d, f"{rank}.err")) for rank in range(len(envs))]
        for path in (p for pair in paths for p in pair):
            open(path, "w").close()
        processes = [context.Process(target=_run_in_child, args=(cmd, cwd, env, *pair))
                     for env, pair in zip(envs, paths)]
        for process in processes:
            process.start()
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p in processes):
            failed = any(p.exitcode not in (None, 0) for p in processes)
            if failed or time.monotonic() > deadline:  # a failed process: the launcher stops the others
                for p in processes:
                    if p.is_alive():
                        p.kill()
                for p in processes:
                    p.join()
                if not failed:
                    raise subprocess.TimeoutExpired(shown, timeout)
                break
            time.sleep(0.05)
        outputs = []
        for out_path, err_path in paths:
            with open(out_path, encoding="utf-8", errors="replace") as f, \
                 open(err_path, encoding="utf-8", errors="replace") as g:
                outputs.append((f.read(), g.read()))
    statuses = [p.exitcode for p in processes]
    status = statuses[0] if len(processes) == 1 else int(any(s != 0 for s in statuses))
    return subprocess.CompletedProcess(shown, status, "".join(o for o, _ in outputs), "".join(e for _, e in outputs))
