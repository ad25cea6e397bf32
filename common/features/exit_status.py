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
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

from common.errors import ERROR_LINES
from common.paths import EXIT_STATUS_FILE, LEFTOVER_PREFIX, METRICS_FILE

STATES = {0: "completed", 2: "error", 3: "diverged", 143: "stopped", 130: "interrupted"}
STOPPED_REASON = "stopped by a signal after saving a checkpoint: rerun with --resume_from_checkpoint latest"


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
                write_exit_status(path, status, reason)

    return main_recording_its_end


def write_exit_status(path: str, status: int, reason: str) -> None:
    """The record, whole or not at all."""
    record = {"exit_status": status, "state": STATES.get(status, "failed"), "reason": reason, "time": int(time.time())}
    temporary = os.path.join(os.path.dirname(path), LEFTOVER_PREFIX + os.path.basename(path))
    try:
        with open(temporary, "w", encoding="utf-8") as f:
            json.dump(record, f)
            f.write("\n")
        os.replace(temporary, path)
    except OSError:  # a full disk: the run's own error already says so
        if os.path.exists(temporary):
            os.remove(temporary)
