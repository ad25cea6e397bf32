"""Each optimizer step's check, the same on every rank: the step's loss over all processes, its gradient norm (of the
all-reduced gradients), whether any rank was asked to stop (riding on the loss's all-reduce), and the verdict.

On a GPU a read of a device value waits for the device's queue to drain. So the three figures stay on the device,
are copied to the host without waiting, and are read a step later (after the next step's work is queued); at once
only where the loop needs them (a logging or checkpoint step, a stop) or where the optimizer cannot skip a step on
the device (`skips_on_device`). The plain check applies every step; the divergence guard
(common/features/divergence.py) skips non-finite ones and stops a diverged run. tests/test_host_syncs.py counts reads.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate import Accelerator

from common.steps import TrainingProgress

DIVERGED_STATUS = 3  # the run diverged: too many non-finite steps in a row, or non-finite weights about to be saved
STOPPED_STATUS = 143  # 128 + SIGTERM: a stop was requested (common/features/preemption.py); a checkpoint was saved


class Verdict(enum.Enum):
    APPLY = "apply"  # step the optimizer and the schedule
    SKIP = "skip"  # a non-finite loss or gradient norm: no update, the run goes on
    DIVERGED = "diverged"  # too many skipped in a row: the run stops (the reason is printed)


@dataclass
class StepCheck:
    """One step's check. `values` (device): loss over all processes, ranks asked to stop, gradient norm (0 when the
    engine reports none). `loss`, `grad_norm`, `stop_requested` are set once `read`; till then `verdict` is APPLY."""
    step: int
    values: torch.Tensor
    has_norm: bool
    verdict: Verdict = Verdict.APPLY
    read: bool = False
    loss: float | None = None
    grad_norm: float | None = None
    stop_requested: bool = False
    ahead: bool = False  # the update went ahead unread (the optimizer skips it on the device if not finite)
    late: torch.Tensor | None = None  # the values' host copy, made without waiting
    late_ready: torch.cuda.Event | None = None  # on a GPU: the copy is complete once the device has passed it


class StepGuard:
    """Checks each optimizer step, identically on every rank (see the module's docstring)."""

    def __init__(self, accelerator: Accelerator, progress: TrainingProgress) -> None:
        self.accelerator, self.progress = accelerator, progress
        self.current: StepCheck | None = None  # the check of the step in progress, until `step_check` takes it
        self.pending: StepCheck | None = None  # the previous step's check, on its way to the host
        self.stop_seen = False  # a read check says a rank was asked to stop: this step is saved, the run ends
        # Whether this process was asked to stop (set by common/features/preemption.py); shared with every rank below.
        self.stop_signalled: Callable[[], bool] = lambda: False

    def skips_on_device(self) -> bool:  # may a step go ahead unread? (the plain check applies every step: yes)
        return True

    def check(self, window_loss: torch.Tensor, grad_norm) -> StepCheck:
        """`window_loss`: this process's share of the step's loss; `grad_norm`: what `accelerator.clip_grad_norm_`
        returned (None when the engine reports none). Collective: every rank calls it once per optimizer step, before
        `optimizer.step()`. Reads the previous step's figures first (their copy is done: no wait for this step)."""
        loss = window_loss.detach().float()
        stops = torch.full_like(loss, float(self.stop_signalled()))  # a fill on the device: no host-to-device copy
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        norm = grad_norm.detach().float().to(loss.device) if isinstance(grad_norm, torch.Tensor) else \
            torch.full_like(loss, float(grad_norm or 0.0))
        values = torch.cat([self.accelerator.reduce(torch.stack([loss, stops]), "sum"), norm.reshape(1)])
        checked = self.current = StepCheck(self.progress.step, values, grad_norm is not None)
        earlier, self.pending = self.pending, None
        if earlier is not None and not earlier.read:
            if earlier.late_ready is not None:
                earlier.late_ready.synchronize()
            self.take_figures(earlier, earlier.late.tolist())
        if earlier is not None and earlier.verdict is Verdict.DIVERGED:
            checked.verdict = Verdict.DIVERGED  # found a step late: this step is not applied either
        elif self.skips_on_device():
            checked.ahead = True
            self.before_update(checked)
            checked.late = torch.empty(values.shape, dtype=values.dtype, pin_memory=values.is_cuda)
            checked.late.copy_(values, non_blocking=values.is_cuda)
            checked.late_ready = torch.cuda.Event() if values.is_cuda else None
            if checked.late_ready is not None:
                checked.late_ready.record()
        else:
            self.read(checked)
        return checked

    def before_update(self, checked: StepCheck) -> None:  # what the optimizer needs to skip an unread step
        pass

    def read(self, checked: StepCheck) -> None:
        """Read the check's values now (the device's queue drains first)."""
        if not checked.read:
            self.take_figures(checked, checked.values.tolist())

    def take_figures(self, checked: StepCheck, values: list[float]) -> None:
        loss, stops, norm = values
        checked.loss, checked.grad_norm = loss, norm if checked.has_norm else None
        checked.stop_requested, checked.read = stops > 0, True
        self.stop_seen = self.stop_seen or checked.stop_requested
        if checked.verdict is not Verdict.DIVERGED:  # else already judged: a diverged run's last step is not applied
            checked.verdict = self.verdict(checked)

    def verdict(self, checked: StepCheck) -> Verdict:  # every step applies (the divergence guard judges them)
        return Verdict.APPLY

    def step_check(self, read: bool = False) -> StepCheck:
        """After a window's micro-batches: the check `check` made at its last one (an error if none: a window always
        ends on the micro-batch that synchronises the gradients). `read`: the loop needs the figures now (a row, a
        checkpoint); they are read on a stop too, else by the next `check`."""
        checked, self.current = self.current, None
        if checked is None:
            raise RuntimeError(f"optimizer step {self.progress.step} ended without synchronising its gradients")
        if read or self.stop_seen:
            self.read(checked)
        self.pending = checked
        checked.stop_requested = checked.stop_requested or self.stop_seen
        return checked
