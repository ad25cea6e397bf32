"""The end of a run as a file, `<output_dir>/exit_status.json`, for automation behind a launcher.

`accelerate launch` (1.15) and torchrun flatten the script's exit status: 2 (bad input), 3 (diverged) and 143 (stopped
by a signal, checkpoint saved) all reach the shell as 1. The script's main process writes what it ended with:

    {"exit_status": 143, "state": "stopped", "reason": "...", "time": 1764320000}

`state` is one of completed (0), error (2: one `error:` line: bad input, a full disk, a resume that contradicts its
checkpoint), diverged (3), stopped (143), interrupted (130: Ctrl-C before the
loop), failed (anything else, with the exception). It describes the last command that ended on the folder. It is
written whole (temporary name, then rename), and only into a folder that holds a run (its metrics.jsonl): a bad input
on a fresh or foreign --output_dir still writes nothing. A command removes an earlier one's file when it starts, so a
run killed outright (SIGKILL, out of memory) leaves none rather than a stale one.

A full disk must not swallow the record (the shell then sees the launcher's 1 and no file): when the command starts,
RESERVED_SIZE bytes are written to `<output_dir>/.reserved-exit_status.json`; a record that cannot be written as
usual is written over that file in place (no new block needed) and the file is renamed. The reservation goes when the
command ends (a folder it had to create for it too, when left empty).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import sys
import time
from collections.abc import Callable

from common.errors import ERROR_LINES
from common.paths import EXIT_STATUS_FILE, LEFTOVER_PREFIX, METRICS_FILE

STATES = {0: "completed", 2: "error", 3: "diverged", 143: "stopped", 130: "interrupted"}
STOPPED_REASON = "stopped by a signal after saving a checkpoint: rerun with --resume_from_checkpoint latest"
RESERVED_FILE = ".reserved-" + EXIT_STATUS_FILE  # the record's room on a full disk
RESERVED_SIZE = 4096  # one page or block: a record whose reason is up to ~3,900 characters


def record_exit_status(main: Callable[[], None], argv: list[str] | None = None) -> Callable[[], None]:
    """`main` that records how it ended in its --output_dir (main process only): `main = record_exit_status(main)`."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--output_dir", default="outputs/run")  # the default of common/flags.py

    def main_recording_its_end() -> None:
        if {"-h", "--help"} & set(sys.argv[1:] if argv is None else argv):
            return main()
        output_dir = parser.parse_known_args(sys.argv[1:] if argv is None else argv)[0].output_dir
        path = os.path.join(output_dir, EXIT_STATUS_FILE)
        main_process = os.environ.get("RANK", "0") == "0"
        if main_process and os.path.isfile(path):
            os.remove(path)
        created = main_process and not os.path.exists(output_dir)
        reserved = reserve_room(output_dir) if main_process else None
        status, reason = 0, ""
        try:
            main()
        except SystemExit as stop:
            status = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            raise
        except KeyboardInterrupt:
            status, reason = 130, "interrupted (Ctrl-C) before the training loop"
            raise
        except BaseException as error:
            status, reason = 1, f"{type(error).__name__}: {error}"
            raise
        finally:
            if main_process and os.path.isfile(os.path.join(output_dir, METRICS_FILE)):
                if not reason and status:
                    reason = STOPPED_REASON if status == 143 else ERROR_LINES[-1] if ERROR_LINES else ""
                write_exit_status(path, status, reason, reserved)
            if reserved and os.path.exists(reserved):
                os.remove(reserved)
            if created:  # a folder made for the reservation alone (bad input): gone again, now or at exit
                remove_if_empty(output_dir)

    return main_recording_its_end


def reserve_room(output_dir: str) -> str | None:
    """RESERVED_SIZE bytes written to RESERVED_FILE in `output_dir` (created if need be, removed again at exit when
    left empty: after the folder lock's own cleanup, registered later); None where nothing can be written."""
    if not os.path.exists(output_dir):
        try:
            os.makedirs(output_dir)
        except OSError:
            return None  # not a place for a folder: the run says so
        atexit.register(remove_if_empty, output_dir)
    reserved = os.path.join(output_dir, RESERVED_FILE)
    try:
        with open(reserved, "wb") as f:
            f.write(b" " * RESERVED_SIZE)
        return reserved
    except OSError:  # not a folder, or already full: the folder lock stops the run with one line
        if os.path.exists(reserved):
            os.remove(reserved)
        return None


def remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:
        pass  # not empty (or gone): what is in it stays


def write_exit_status(path: str, status: int, reason: str, reserved: str | None = None) -> None:
    """The record, whole or not at all: as a new file renamed into place, or (a full disk) over the reserved file."""
    record = {"exit_status": status, "state": STATES.get(status, "failed"), "reason": reason, "time": int(time.time())}
    temporary = os.path.join(os.path.dirname(path), LEFTOVER_PREFIX + os.path.basename(path))
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.write("\n")
        os.replace(temporary, path)
        return
    except OSError:
        if os.path.exists(temporary):
            os.remove(temporary)
    if reserved and os.path.exists(reserved):  # a full disk: the room kept for it since the start
        text = json.dumps(record)
        if len(text.encode()) >= RESERVED_SIZE:
            text = json.dumps({**record, "reason": reason[:RESERVED_SIZE // 4 - 100] + "..."})
        try:
            with open(reserved, "r+b") as f:
                f.write(text.encode() + b"\n")
                f.truncate()
            os.replace(reserved, path)
        except OSError:
            pass  # the run's own error line already says what went wrong
