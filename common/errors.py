"""One-line errors for bad input: the only way the scripts and `common/` stop a run on purpose."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NoReturn

if TYPE_CHECKING:
    from accelerate import Accelerator

from tqdm import tqdm


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
        print(f"error: {message}", file=sys.stderr, flush=True)
    accelerator.wait_for_everyone()
    raise SystemExit(2)
