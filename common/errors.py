"""One-line errors for bad input: the only way the scripts and `common/` stop a run on purpose."""

from __future__ import annotations

import sys
from typing import NoReturn

from tqdm import tqdm


def fail(message: str) -> NoReturn:
    """Stop with one clear line on stderr (`error: ...`) and exit status 2.

    Open progress bars are closed first: otherwise they redraw at exit, after the error line.
    """
    for bar in list(tqdm._instances):
        bar.close()
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
