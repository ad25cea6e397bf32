"""Each optimizer step's check, the same on every rank: the step's loss over all processes, its gradient norm (of the
all-reduced gradients), whether any rank was asked to stop (riding on the loss's all-reduce), and the verdict.

On a GPU every read of a device value to the host waits for the device's queue to drain: the GPU idles while the
host catches up. So the check's three figures stay on the device: they are copied to the host without waiting and
read one step later (`StepCheck.late`), after the next step's forward and backward are queued, when the device has
long passed them. They are read at once only where the loop needs them: a logging or checkpoint step
(`step_check(read=True)`), a stop, and an optimizer that can only skip a step on the host's word
(`StepGuard.skips_on_device`). tests/test_host_syncs.py counts the reads.

The plain check applies every step; the divergence guard (common/features/divergence.py) skips non-finite ones, on
the device where the optimizer can, and stops a diverged run.
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
    """One optimizer step as every rank sees it. `values` (on the device): the step's loss over all processes, the
    number of ranks asked to stop, the gradient norm (0 when the engine reports none: `has_norm`). The host figures
    (`loss`, `grad_norm`, `stop_requested`) are filled in when the values are read (`read`); until then `verdict` is
    the provisional APPLY of a step that the optimizer skips on the device if it is not finite."""
    step: int
    values: torch.Tensor
    has_norm: bool
    verdict: Verdict = Verdict.APPLY
    read: bool = False
    loss: float | None = None
    grad_norm: float | None = None
    stop_requested: bool = False
    ahead: bool = False  # the update went ahead unread: the optimizer skips it on the device if it is not finite
    late: torch.Tensor | None = None  # the values' host copy, made without waiting (read a step later)
    late_ready: object = None  # a CUDA event: the copy is complete once the device has passed it


class StepGuard:
    """Checks each optimizer step, identically on every rank (see the module's docstring)."""

    def __init__(self, accelerator: Accelerator, progress: TrainingProgress) -> None:
        self.accelerator, self.progress = accelerator, progress
        self.current: StepCheck | None = None  # the check of the step in progress, until `step_check` takes it
        self.pending: StepCheck | None = None  # an earlier step's check not read yet (its copy is on its way)
        self.stop_seen = False  # a read check said that a rank was asked to stop: this step is saved and the run ends
        # Whether this process was asked to stop (set by common/features/preemption.py); shared with every rank below.
        self.stop_signalled: Callable[[], bool] = lambda: False

    def skips_on_device(self) -> bool:
        """Whether a step may go ahead before its figures are read. The plain check applies every step: yes."""
        return True

    def check(self, window_loss: torch.Tensor, grad_norm) -> StepCheck:
        """`window_loss`: this process's share of the step's loss (the shares of all processes sum to it);
        `grad_norm`: what `accelerator.clip_grad_norm_` returned (None when the engine does not report it).

        Collective: every rank calls it once per optimizer step, before `optimizer.step()`. Returns the verdict the
        loop acts on; reads the previous step's figures (copied a step ago: no wait for this step's work).
        """
        loss = window_loss.detach().float()
        # full_like: a fill on the device, no host-to-device copy (which would wait for the device's queue too)
        stops = torch.full_like(loss, float(self.stop_signalled()))
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        if isinstance(grad_norm, torch.Tensor):
            norm = grad_norm.detach().float().to(loss.device)
        else:
            norm = torch.full_like(loss, 0.0 if grad_norm is None else float(grad_norm))
        loss_and_stops = self.accelerator.reduce(torch.stack([loss, stops]), "sum")
        checked = StepCheck(self.progress.step, torch.cat([loss_and_stops, norm.reshape(1)]), grad_norm is not None)
        earlier = self.read_pending()
        if earlier is not None and earlier.verdict is Verdict.DIVERGED:
            checked.verdict = Verdict.DIVERGED  # found a step late: this step is not applied either
        elif self.skips_on_device():
            checked.ahead = True
            self.before_update(checked)
            self.copy_to_host(checked)
        else:
            self.read(checked)
        self.current = checked
        return checked

    def before_update(self, checked: StepCheck) -> None:
        """A step that goes ahead unread: what the optimizer needs to skip it on the device (nothing here)."""

    def copy_to_host(self, checked: StepCheck) -> None:
        """Start the copy of the check's values to the host; `read_pending` reads it a step later."""
        on_gpu = checked.values.is_cuda
        checked.late = torch.empty(checked.values.shape, dtype=checked.values.dtype, pin_memory=on_gpu)
        checked.late.copy_(checked.values, non_blocking=on_gpu)
        if on_gpu:
            checked.late_ready = torch.cuda.Event()
            checked.late_ready.record()

    def read_pending(self) -> StepCheck | None:
        """The earlier step's check, read now from its host copy (waits only until the device has passed that step,
        while this step's work stays queued behind it)."""
        earlier, self.pending = self.pending, None
        if earlier is not None and not earlier.read:
            if earlier.late_ready is not None:
                earlier.late_ready.synchronize()
            self.take_figures(earlier, earlier.late.tolist())
        return earlier

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

    def verdict(self, checked: StepCheck) -> Verdict:
        """Every step is applied (the divergence guard judges non-finite ones)."""
        return Verdict.APPLY

    def step_check(self, read: bool = False) -> StepCheck:
        """After a window's micro-batches: the check `check` made at its last one (an error if it made none: a window
        always ends on the micro-batch that synchronises the gradients, common/steps.py).

        `read`: the loop needs this step's figures now (a logging or checkpoint step); they are also read when a rank
        has asked to stop. Otherwise they stay on their way to the host and the next `check` reads them.
        """
        checked, self.current = self.current, None
        if checked is None:
            raise RuntimeError(f"optimizer step {self.progress.step} ended without synchronising its gradients")
        if read or self.stop_seen:
            self.read(checked)
        else:
            self.pending = checked
        checked.stop_requested = checked.stop_requested or self.stop_seen
        return checked
