#!/usr/bin/env python
"""`accelerate launch` that waits for its trainers' checkpoint when it is signalled, and returns the run's status.

    python tools/launch.py --config_file accelerate_configs/default.yaml scripts/pretrain_llama.py ...

Same arguments as `accelerate launch` (it runs accelerate 1.15's own launcher in this process). Why: a supervisor
that signals the launcher's PID and waits for it (a container's PID 1, a CI job, a wrapper script) must see it end
only once the trainers have saved. `accelerate launch` with one process starts the trainer with a plain `Popen` and
dies of a SIGTERM at once (the shell gets 143 while the trainer is still saving, orphaned). Here SIGTERM, SIGINT
and SIGUSR1 are passed on to the trainers, which stop after their step with a checkpoint and `exit_status.json`,
and the launcher waits for them. With several processes torch's elastic agent forwards SIGTERM/SIGINT itself and
waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (default 30) before SIGKILL; SIGUSR1, which it does not handle,
is passed on here.

Exit status: with one process the trainer's own (0, 2, 3, 143); with several the first failed rank's, or 128 + N
once the agent, signalled with N, has seen its workers end. accelerate's own report of a failed trainer (a
`CalledProcessError` traceback) is not printed: the script's `error:` line is the last line, as with `--quiet`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import psutil
from accelerate.commands.launch import launch_command, launch_command_parser
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def pass_on(signum: int, frame) -> None:
    """Hand the signal to the trainers (this process's children) and keep waiting for them."""
    children = psutil.Process().children()
    if not children:  # no trainer yet: the signal ends the launcher, as it would `accelerate launch`
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    for child in children:
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:
            pass


def shell_status(returncode: int) -> int:
    """A process's status as a shell reports it: a death by signal N is 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def main(argv: list[str] | None = None) -> int:
    args = launch_command_parser().parse_args(argv)
    args.quiet = False  # so that a failed trainer's status comes back (as CalledProcessError) instead of 1
    for sig in FORWARDED:  # torch's agent replaces the handlers of the signals it forwards itself
        signal.signal(sig, pass_on)
    try:
        launch_command(args)
    except subprocess.CalledProcessError as failed:  # one process: the trainer's own status
        return shell_status(failed.returncode)
    except ChildFailedError as failed:  # several: torch's report (its root cause shows the error line)
        print(failed.format_msg(), file=sys.stderr)
        return shell_status(failed.get_first_failure()[1].exitcode) or 1
    except SignalException as stopped:  # the agent forwarded it and its workers have ended
        return 128 + stopped.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
