"""Test helper, not a training script: runs a script as if this machine had 1 MiB of free memory.

    accelerate launch --config_file accelerate_configs/<config> tests/little_free_memory.py scripts/<script>.py ...

`psutil.virtual_memory().available` reports 1 MiB (the rest of its answer is the real one), so the paths taken when a
full model would not fit in memory can be tested on a small model.
"""

from __future__ import annotations

import runpy
import sys

import psutil

_virtual_memory = psutil.virtual_memory
psutil.virtual_memory = lambda: _virtual_memory()._replace(available=1 << 20)

if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
