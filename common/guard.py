"""The divergence guard: each optimizer step's verdict (apply the update, skip it, or stop: diverged), the same on every
rank, from the step's loss and gradient norm; and the check that no non-finite weight is ever saved.

The verdict is the same on every rank: the step's loss is all-reduced here and the gradient norm from
`accelerator.clip_grad_norm_` is computed on the all-reduced gradients. Whether any rank received a stop signal rides
on the same all-reduce, so the step's loss, gradient norm and stop request come to the host in one read: the only
read of a device value a training loop makes outside logging steps (on a GPU each read waits for the device's queue
to drain; tests/test_host_syncs.py counts them). A skipped step leaves the optimizer (moments, step count) and the
learning-rate schedule untouched; the loop's `zero_grad` drops its gradients.

Two engines skip such steps themselves, before the loop can:
- fp16 loss scaling (a CUDA GradScaler): an overflow (finite loss, inf gradients) is normal while the scale settles.
  The verdict is then APPLY: the scaler skips the update and lowers its scale. The step is logged as skipped; only a
  non-finite loss counts towards divergence.
- DeepSpeed steps inside `accelerator.backward`. DeepSpeed 0.19.8's ZeRO-1/2/3 optimizers check the gradient norm
  (fp32, bf16 and fp16) and on inf/NaN skip the update and their own schedule, zero the gradients and report the
  norm as inf, which this guard then counts. A non-finite loss whose gradients are finite is applied there; the
  weight check before every save and export still refuses non-finite weights.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from common.errors import report_error

if TYPE_CHECKING:
    from common.steps import TrainingProgress

logger = get_logger(__name__)
DIVERGED_STATUS = 3  # the run diverged: too many non-finite steps in a row, or non-finite weights about to be saved
STOPPED_STATUS = 143  # 128 + SIGTERM: a stop was requested (common/features/preemption.py); a checkpoint was saved


class Verdict(enum.Enum):
    APPLY = "apply"  # step the optimizer and the schedule
    SKIP = "skip"  # a non-finite loss or gradient norm: no update, the run goes on
    DIVERGED = "diverged"  # too many skipped in a row: the run stops (the reason is printed)


@dataclass
class StepCheck:
    """One optimizer step as every rank sees it: its loss over all processes, its gradient norm, the verdict, and
    whether any rank has received a stop signal (then every rank saves this step and returns)."""
    loss: float
    grad_norm: float | None
    verdict: Verdict
    stop_requested: bool = False


class NonFiniteGuard:
    """Judges each optimizer step, identically on every rank (see the module's docstring)."""

    def __init__(self, accelerator: Accelerator, progress: TrainingProgress, max_consecutive: int) -> None:
        self.accelerator, self.progress, self.max_consecutive = accelerator, progress, max_consecutive
        self.loss_scaling = accelerator.mixed_precision == "fp16"
        self.consecutive = 0
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
        loss_and_stops = self.accelerator.reduce(torch.stack([loss, torch.full_like(loss, float(self.stop_signalled()))]),
                                                 "sum")
        if hasattr(grad_norm, "full_tensor"):  # FSDP2: a DTensor, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        if isinstance(grad_norm, torch.Tensor):  # one read to the host for all three figures
            grad_norm = grad_norm.detach().float().to(loss.device).reshape(1)
            loss_sum, stops, norm = torch.cat([loss_and_stops, grad_norm]).tolist()
        else:
            (loss_sum, stops), norm = loss_and_stops.tolist(), None if grad_norm is None else float(grad_norm)
        self.last = StepCheck(loss_sum, norm, self._verdict(loss_sum, norm), stop_requested=stops > 0)
        return self.last

    def step_check(self) -> StepCheck:
        """After a window's micro-batches: the check `check` made at its last one (an error if it made none: a window
        always ends on the micro-batch that synchronises the gradients, common/steps.py)."""
        checked, self.last = self.last, None
        if checked is None:
            raise RuntimeError(f"optimizer step {self.progress.step} ended without synchronising its gradients")
        return checked

    def _verdict(self, loss: float, norm: float | None) -> Verdict:
        if math.isfinite(loss) and (norm is None or math.isfinite(norm)):
            self.consecutive = 0
            return Verdict.APPLY
        if self.loss_scaling and math.isfinite(loss):
            return Verdict.APPLY  # a gradient overflow while the loss scale settles: the scaler skips the update
        self.consecutive += 1
        step = self.progress.step
        logger.warning(f"optimizer step {step}: loss {loss:.4g}, gradient norm {norm if norm is None else f'{norm:.4g}'}"
                       f": not finite, the update is skipped on every rank ({self.consecutive} in a row, "
                       f"--max_nonfinite_steps {self.max_consecutive})")
        if self.consecutive < self.max_consecutive:
            return Verdict.SKIP
        report_error(self.accelerator, f"training diverged: optimizer steps {step - self.consecutive + 1}-{step} had "
                     f"a non-finite loss or gradient norm ({self.consecutive} in a row, --max_nonfinite_steps "
                     f"{self.max_consecutive}); their updates were skipped, the weights are finite. Resume from an "
                     "earlier checkpoint with a lower --learning_rate (or more --warmup_steps)")
        return Verdict.DIVERGED


def _local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this process holds: a ZeRO-3 partition, an FSDP2 DTensor's shard, or the tensor."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param


def weights_are_finite(accelerator: Accelerator, models: list[torch.nn.Module], what: str) -> bool:
    """False on every rank (the reason printed once) when any weight of `models` is NaN or inf on any rank: then
    `what` must not be written and the run stops with DIVERGED_STATUS.

    Collective (every rank checks its shards): call it on all ranks, before a checkpoint or an export. Frozen
    weights are not checked: training never changes them (and a 4-bit base's packed bytes are not numbers).
    """
    bad = [name for model in models for name, p in model.named_parameters()
           if p.requires_grad and not torch.isfinite(_local_shard(p).detach()).all()]
    total = int(accelerator.reduce(torch.tensor(len(bad), device=accelerator.device), "sum").item())
    if total:
        example = f", e.g. {bad[0]}" if bad else ""
        report_error(accelerator, f"refusing to save {what}: {total} weight tensors hold NaN or inf{example}. The run "
                     "diverged; resume from an earlier checkpoint with a lower --learning_rate")
    return not total
