"""Test helper, not a training script: rank 0 waits in a barrier that rank 1 never joins.

    accelerate launch --config_file accelerate_configs/<config> tests/stalled_collective.py --ddp_timeout 10

The process group comes from `common.runtime.build_accelerator`, as in the training scripts. Rank 1 sleeps far longer
than the timeout (a rank stuck elsewhere: in another collective, a dead data loader), so only the process group's
timeout can end rank 0's wait early. Rank 0 prints `waited <seconds> s: <error>` and re-raises.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.flags import ArgumentParser, add_training_args
from common.runtime import build_accelerator


def main() -> None:
    parser = ArgumentParser()
    add_training_args(parser)
    parser.add_argument("--stall_seconds", type=float, default=600, help="How long rank 1 stays away.")
    args = parser.parse_args()
    accelerator = build_accelerator(args)
    if accelerator.process_index != 0:
        time.sleep(args.stall_seconds)
        return
    start = time.perf_counter()
    try:
        accelerator.wait_for_everyone()
    except Exception as error:
        print(f"waited {time.perf_counter() - start:.1f} s: {type(error).__name__}: {error}", flush=True)
        raise
    print(f"barrier passed after {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
