"""Bad input stops a run with one clear line: `fail` before the processes work together, `fail_on_every_rank` after;
`report_error` prints such a line for a run that stops with its own status (a diverged run)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, NoReturn

from common.upstream import open_progress_bars

if TYPE_CHECKING:
    from accelerate import Accelerator

ERROR_LINES: list[str] = []  # this process's `error:` lines (common/features/exit_status.py records the last)


def fail(message: str) -> NoReturn:
    """Stop with one clear line on stderr (`error: ...`) and exit status 2.

    Under a multi-process launch every process meets the same bad input, and the line is printed once per machine,
    by local rank 0.
    """
    line = f"error: {message}"
    leave_for_launcher(line)
    if os.environ.get("LOCAL_RANK", "0") != "0":
        # Local rank 0 prints the line; its exit makes the launcher stop this process. Exiting first could get rank 0
        # stopped before it has printed.
        time.sleep(5)
    else:
        print_last(line)
    raise SystemExit(2)


def fail_on_every_rank(accelerator: Accelerator, message: str) -> NoReturn:
    """`fail` once the processes have started: every rank stops (status 2), the main process alone prints the line.

    Every rank must call it. The barrier keeps the others alive until the line is out: when one rank exits, the
    launcher stops the rest, possibly before their print.
    """
    report_error(accelerator, message)
    accelerator.wait_for_everyone()
    raise SystemExit(2)


def report_error(accelerator: Accelerator, message: str) -> None:
    """The run's one `error: ...` line, printed once (main process) as the last line, and named to the launcher."""
    line = f"error: {message}"
    leave_for_launcher(line)
    if accelerator.is_main_process:
        print_last(line)


def print_last(line: str) -> None:
    """Print `line` on stderr after closing the open progress bars (they would otherwise redraw after it at exit)."""
    for bar in open_progress_bars():
        bar.close()
    print(line, file=sys.stderr, flush=True)


def leave_for_launcher(line: str) -> None:
    """Write `line` into torch elastic's error file (torchrun sets one per process), so `accelerate launch`'s failure
    report names it as the root cause (also when only another rank failed)."""
    ERROR_LINES.append(line)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the report then says "error_file: <N/A>"


def missing_local_path(name: str) -> bool:
    """A name that can only mean a local path (absolute, `./`, `~`, or inside an existing folder), and is missing;
    other names may be hub ids (`org/model`)."""
    looks_local = os.path.isabs(name) or name.startswith((".", "~")) or os.path.isdir(os.path.dirname(name))
    return looks_local and not os.path.exists(os.path.expanduser(name))
