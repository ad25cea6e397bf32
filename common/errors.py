"""How the scripts and `common/` stop a run on purpose: `fail` for bad input (one line, exit 2), `StopTraining` for a
run that stops early with its own status (a stop signal after its checkpoint, a diverged run)."""

from __future__ import annotations

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """Stop with one clear line on stderr (`error: ...`) and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


class StopTraining(SystemExit):
    """Raised inside the training loop on every rank at once; `common.runtime.finishing` tears the run down cleanly
    (trackers, process group) and exits with `code`."""
