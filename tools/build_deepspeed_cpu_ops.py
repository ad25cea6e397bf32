"""Build DeepSpeed's two C++ ops that CPU runs use, once per machine, before the first DeepSpeed run needs them.

    python tools/build_deepspeed_cpu_ops.py

DeepSpeed compiles its ops on first use (JIT) into torch's extension cache (~/.cache/torch_extensions/py311_cpu, or
$TORCH_EXTENSIONS_DIR): `deepspeed_shm_comm` at every DeepSpeed start on a CPU (its collectives) and `cpu_adam` for the
offload configs. On the 2-core machine that is about 2 minutes the first run pays, while other runs wait on its build
lock; the test command of the README builds both here instead, both at once, and the later runs load them from the
cache. A GPU machine does not need this: DeepSpeed builds what it uses there on first use, as usual.
"""

from __future__ import annotations

import concurrent.futures
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the scripts and the tests set it on a machine without a GPU

OPS = ("ShareMemCommBuilder", "CPUAdamBuilder")


def build(name: str) -> str:
    from deepspeed.accelerator import get_accelerator

    began = time.monotonic()
    get_accelerator().create_op_builder(name).load(verbose=False)
    return f"{name}: ready in {time.monotonic() - began:.0f} s"


if __name__ == "__main__":
    # One process per op: each build is one compiler process most of its time, so two cores build both at once.
    with concurrent.futures.ProcessPoolExecutor(len(OPS)) as pool:
        for line in pool.map(build, OPS):
            print(line, flush=True)
