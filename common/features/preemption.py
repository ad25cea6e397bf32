"""Graceful stop on SIGTERM, SIGINT and SIGUSR1 (Slurm `--signal`, Kubernetes, Ctrl-C): the loop finishes the current
optimizer step on every rank, saves a checkpoint, says how to continue and ends the run with status 143.

The handler only records the signal. Once per optimizer step the loop hands `stop_signalled()` to the divergence
guard, whose all-reduce carries it to every rank with the step's loss (`common/guard.py`: one read to the host for
both), so every rank stops after the same step even when only one of them was signalled.

Launchers, measured with accelerate 1.15 / torch 2.13 on Linux:
- `accelerate launch` with one process starts the script with a plain `Popen` and does not forward signals: a
  SIGTERM to the launcher's PID alone kills the launcher and leaves the trainer running, orphaned.
- with several processes (torchrun's agent) the workers run in their own session; the agent forwards SIGTERM, SIGINT
  (and whatever `PET_SIGNALS_TO_HANDLE` lists) and waits `TORCH_ELASTIC_SHUTDOWN_TIMEOUT` seconds (default 30)
  before SIGKILL, but dies of SIGUSR1 without forwarding it.
So a process started by a launcher asks the kernel for SIGTERM when its parent dies (prctl PR_SET_PDEATHSIG):
whatever kills the launcher, the trainers stop gracefully within a step.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable

from accelerate.logging import get_logger

from common.guard import STOPPED_STATUS

logger = get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_received: list[str] = []  # names of the stop signals this process got


def _record(signum: int, frame) -> None:  # a signal handler: record only, act at the next step boundary
    _received.append(signal.Signals(signum).name)


def catch_stop_signals() -> Callable[[], bool]:
    """From now on SIGTERM/SIGINT/SIGUSR1 end the run after the current optimizer step, with a checkpoint; returns
    `stop_signalled`, for the divergence guard to share with every rank (`guard.stop_signalled`).

    Call it just before the training loop: before it there is nothing to save, so a signal stops at once.
    """
    if threading.current_thread() is threading.main_thread():  # Python allows handlers only there
        for sig in STOP_SIGNALS:
            signal.signal(sig, _record)
    return stop_signalled


def stop_when_launcher_dies() -> None:
    """A process started by a launcher (accelerate, torchrun, deepspeed) gets SIGTERM when that launcher dies.

    Not for a script run directly: `nohup python script.py &` must survive its shell.
    """
    launched = "LOCAL_RANK" in os.environ or "ACCELERATE_DYNAMO_BACKEND" in os.environ  # torchrun / accelerate
    if launched and sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def stop_signalled() -> bool:
    """Whether this process has received a stop signal (local: no collective; the guard shares it with every rank)."""
    return bool(_received)


def announce_stop(step: int, checkpoint: str) -> None:
    """Say where the run stopped and how to continue it (the run then ends with STOPPED_STATUS)."""
    why = f"on {_received[0]}" if _received else "on another process's signal"
    logger.warning(f"Stopped {why} after optimizer step {step}; checkpoint saved in {checkpoint}. To continue, run "
                   f"the same command with --resume_from_checkpoint {checkpoint} (exit status {STOPPED_STATUS})")
