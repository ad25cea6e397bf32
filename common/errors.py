"""One-line errors for bad input: the only way the scripts and `common/` stop a run on purpose."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """Stop with one clear line on stderr (`error: ...`) and exit status 2.

    Under a multi-process launch every process meets the same bad input, and the line is printed once per machine,
    by local rank 0. Every process also leaves it in torch elastic's error file, so the failure report that
    `accelerate launch` prints after a multi-process run names it as the root cause (also when only another rank
    failed).
    """
    line = f"error: {message}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each process
    if error_file:
        try:
            with open(error_file, "w", encoding="utf-8") as f:
                json.dump({"message": line, "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the report then says "error_file: <N/A>"
    if os.environ.get("LOCAL_RANK", "0") != "0":
        # Local rank 0 prints the line; its exit makes the launcher stop this process. Exiting first could get rank 0
        # stopped before it has printed.
        time.sleep(5)
    else:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)
