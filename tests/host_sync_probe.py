"""Run a training script with every read of a tensor's value to the host recorded, per optimizer step.

    python tests/host_sync_probe.py OUT_PREFIX scripts/<recipe>.py [flags...]
    accelerate launch ... tests/host_sync_probe.py OUT_PREFIX scripts/<recipe>.py [flags...]

On a GPU each such read (`.item()`, `.tolist()`, `bool()`, `float()`, `int()`, `.cpu()`, `.numpy()`) waits for the
device's queue to drain. On this CPU nothing waits, so the reads are counted where the Python code asks for them.
Reads inside `torch.optim` (the optimizers' step counters) and `torch.utils.data` (the samplers' random numbers) are
left out: those tensors live on the host on a GPU machine too. So are reads of a step check's host copy
(`StepCheck.late` in common/guard.py, filled by a non-blocking copy and read a step later, when the device has passed
it): they are recorded apart, as "late" reads, with the step whose check they read.

Writes OUT_PREFIX.<rank>.json: {"steps": [[call site, ...] per optimizer step], "late": [[step read, ...] per
optimizer step]}. A step's reads are those after the previous step's `StepLog.step` returned up to its own (so a
logging step's row counts as its own).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")
steps: list[list[str]] = []
current: list[str] = []
late_steps: list[list[int]] = []
late: list[int] = []
late_copies: dict[int, int] = {}  # id of a StepCheck.late tensor -> the step of its check
kept_alive: list = []  # those tensors (a freed tensor's id could be reused by another)
counting = False


def call_site() -> str | None:
    """Where the read was asked for (the innermost frame outside torch's tensor class), or None for a host tensor."""
    frames = traceback.extract_stack()[:-2]
    host_side = (f"{os.sep}torch{os.sep}optim{os.sep}", f"{os.sep}torch{os.sep}utils{os.sep}data{os.sep}")
    if any(part in f.filename for f in frames for part in host_side):
        return None
    frame = next(f for f in reversed(frames) if not f.filename.endswith(f"torch{os.sep}_tensor.py"))
    return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno} {frame.name}"


def recorded(name: str):
    original = getattr(torch.Tensor, name)

    def read(self, *args, **kwargs):
        global counting
        if counting:
            counting = False  # a read inside a read (e.g. tolist -> item) is one read
            try:
                site = None if id(self) in late_copies else call_site()
                if id(self) in late_copies:
                    late.append(late_copies[id(self)])
                if site:
                    current.append(f"{name}: {site}")
            finally:
                counting = True
        return original(self, *args, **kwargs)

    return read


def main() -> None:
    out_prefix, script, *flags = sys.argv[1:]
    for name in READS:
        setattr(torch.Tensor, name, recorded(name))

    import common.guard
    import common.metrics
    import common.features.preemption

    check = common.guard.StepGuard.check

    def check_and_mark_the_late_copy(self, *args, **kwargs):
        checked = check(self, *args, **kwargs)
        if checked.late is not None:
            late_copies[id(checked.late)] = checked.step
            kept_alive.append(checked.late)
        return checked

    start = common.features.preemption.catch_stop_signals
    log_step, log_close = common.metrics.StepLog.step, common.metrics.StepLog.close

    def catch_stop_signals_and_count():  # called just before each loop starts
        global counting
        stop_signalled = start()
        current.clear()
        counting = True
        return stop_signalled

    def step(self, *args, **kwargs):
        log_step(self, *args, **kwargs)
        steps.append(list(current))
        late_steps.append(list(late))
        current.clear()
        late.clear()

    def close(self):
        global counting
        counting = False
        log_close(self)

    common.features.preemption.catch_stop_signals = catch_stop_signals_and_count
    common.guard.StepGuard.check = check_and_mark_the_late_copy
    common.metrics.StepLog.step, common.metrics.StepLog.close = step, close
    sys.argv = [script, *flags]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        with open(f"{out_prefix}.{os.environ.get('RANK', '0')}.json", "w") as f:
            json.dump({"steps": steps, "late": late_steps}, f, indent=1)


if __name__ == "__main__":
    main()
