"""Each optimizer step's check, the same on every rank: the step's loss over all processes, its gradient norm (of the
all-reduced gradients), whether any rank was asked to stop (riding on the loss's all-reduce), and the verdict.

The three come to the host in one read: the only read of a device value a loop makes outside logging steps (on a GPU
each read waits for the device's queue; tests/test_host_syncs.py counts them). The plain check applies every step;
the divergence guard (common/features/divergence.py) skips non-finite ones and stops a diverged run.
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
    """One optimizer step as every rank sees it: its loss over all processes, its gradient norm, the verdict, and
    whether any rank has asked to stop (then every rank saves this step and returns)."""
    loss: float
    grad_norm: float | None
    verdict: Verdict
    stop_requested: bool = False


class StepGuard:
    """Checks each optimizer step, identically on every rank (see the module's docstring)."""

    def __init__(self, accelerator: Accelerator, progress: TrainingProgress) -> None:
        self.accelerator, self.progress = accelerator, progress
        self.last: StepCheck | None = None  # the check of the step in progress, until `step_check` takes it
        # Whether this process was asked to stop (set by common/features/preemption.py); shared with every rank below.
        self.stop_signalled: Callable[[], bool] = lambda: False

    def check(self, window_loss: torch.Tensor, grad_norm) -> StepCheck:
        """`window_loss`: this process's share of the step's loss (the shares of all processes sum to it);
        `grad_norm`: what `accelerator.clip_grad_norm_` returned (None when the engine does not report it).

        Collective: every rank calls it once per optimizer step, before `optimizer.step()`.
        """
        loss = window_loss.detach().float()
        # full_like: a fill on the device, no host-to-device copy (which would wait for the device's queue too)
        loss_and_stops = self.accelerator.reduce(
            torch.stack([loss, torch.full_like(loss, float(self.stop_signalled()))]), "sum")
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        if isinstance(grad_norm, torch.Tensor):  # one read to the host for all three figures
            grad_norm = grad_norm.detach().float().to(loss.device).reshape(1)
            loss_sum, stops, norm = torch.cat([loss_and_stops, grad_norm]).tolist()
        else:
            (loss_sum, stops), norm = loss_and_stops.tolist(), None if grad_norm is None else float(grad_norm)
        self.last = StepCheck(loss_sum, norm, self.verdict(loss_sum, norm), stop_requested=stops > 0)
        return self.last

    def verdict(self, loss: float, norm: float | None) -> Verdict:
        """Every step is applied (the divergence guard judges non-finite ones)."""
        return Verdict.APPLY

    def step_check(self) -> StepCheck:
        """After a window's micro-batches: the check `check` made at its last one (an error if it made none: a window
        always ends on the micro-batch that synchronises the gradients, common/steps.py)."""
        checked, self.last = self.last, None
        if checked is None:
            raise RuntimeError(f"optimizer step {self.progress.step} ended without synchronising its gradients")
        return checked
