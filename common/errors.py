"""One-line errors for bad input: the only way the scripts and `common/` stop a run on purpose."""

from __future__ import annotations

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """Stop with one clear line on stderr (`error: ...`) and exit status 2."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)
