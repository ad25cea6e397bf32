"""How the scripts and `common/` stop a run on purpose: `fail` for bad input (one line, exit 2), `StopTraining` for a
run that stops early with its own status (a stop signal after its checkpoint, a diverged run)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

from tqdm import tqdm

if TYPE_CHECKING:
    from accelerate import Accelerator


def fail(message: str) -> NoReturn:
    """Stop with one clear line on stderr (`error: ...`) and exit status 2.

    Open progress bars are closed first: otherwise they redraw at exit, after the error line.
    """
    for bar in list(tqdm._instances):
        bar.close()
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def fail_on_every_rank(accelerator: Accelerator, message: str) -> NoReturn:
    """`fail` once the processes have started: every rank stops (status 2), the main process alone prints the line.

    Every rank must call it. The barrier keeps the others alive until the line is out: when one rank exits, the
    launcher stops the rest, possibly before their print.
    """
    if accelerator.is_main_process:
        for bar in list(tqdm._instances):
            bar.close()
        print(f"error: {message}", file=sys.stderr, flush=True)
    accelerator.wait_for_everyone()
    raise SystemExit(2)


class StopTraining(SystemExit):
    """Raised inside the training loop on every rank at once; `common.runtime.finishing` tears the run down cleanly
    (trackers, process group) and exits with `code`."""
