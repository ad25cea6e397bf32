"""Divergence guard: an optimizer step whose loss or gradient norm is not finite is skipped on every rank; too many in a
row stop the run; non-finite weights are never saved.

The decision is the same on every rank: the gradient norm from `accelerator.clip_grad_norm_` is computed on the
all-reduced gradients, and the step's loss is reduced over the processes before the check. A skipped step leaves
the optimizer (moments, step count) and the learning-rate schedule untouched; the loop's `zero_grad` drops its
gradients.

Two engines skip such steps themselves, before the loop can:
- fp16 loss scaling (a CUDA GradScaler): an overflow (finite loss, inf gradients) is normal while the scale settles.
  `optimizer.step()` is always called: the scaler skips the update and lowers its scale. The step is counted as
  skipped; only a non-finite loss counts towards divergence.
- DeepSpeed steps inside `accelerator.backward`. DeepSpeed 0.19.8's ZeRO-1/2/3 optimizers check the gradient norm
  (fp32, bf16 and fp16) and on inf/NaN skip the update and their own schedule, zero the gradients and report the
  norm as inf, which this guard then counts. A non-finite loss whose gradients are finite is applied there; the
  weight check before every save and export still refuses non-finite weights.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from common.errors import StopTraining

if TYPE_CHECKING:
    from common.steps import TrainingProgress

logger = get_logger(__name__)
DIVERGED_STATUS = 3  # the run diverged: too many non-finite steps in a row, or non-finite weights about to be saved


def _stop(accelerator: Accelerator, message: str) -> None:
    if accelerator.is_main_process:
        print(f"error: {message}", file=sys.stderr, flush=True)
    raise StopTraining(DIVERGED_STATUS)


class NonFiniteGuard:
    """Decides, once per optimizer step and identically on every rank, whether the update may be applied."""

    def __init__(self, accelerator: Accelerator, progress: TrainingProgress, max_consecutive: int) -> None:
        self.accelerator, self.progress, self.max_consecutive = accelerator, progress, max_consecutive
        self.loss_scaling = accelerator.mixed_precision == "fp16"
        self.consecutive = 0

    def allows_update(self, loss: float, grad_norm) -> bool:
        """False: skip `optimizer.step()` and the scheduler. Under fp16 loss scaling always True: the scaler itself
        skips an update whose gradients hold inf/NaN, and must see the step to lower its scale.

        `loss`: the step's loss over all processes; `grad_norm`: the all-reduced norm (None when unknown).
        """
        norm = math.nan if grad_norm is None else float(grad_norm)
        if math.isfinite(loss) and (grad_norm is None or math.isfinite(norm)):
            self.consecutive = 0
            return True
        if self.loss_scaling and math.isfinite(loss):
            return True  # a gradient overflow while the loss scale settles: not divergence
        self.consecutive += 1
        step = self.progress.step
        logger.warning(f"optimizer step {step}: loss {loss:.4g}, gradient norm {norm:.4g}: not finite, the update is "
                       f"skipped on every rank ({self.consecutive} in a row, --max_nonfinite_steps "
                       f"{self.max_consecutive})")
        if self.consecutive >= self.max_consecutive:
            _stop(self.accelerator, f"training diverged: optimizer steps {step - self.consecutive + 1}-{step} had a "
                  f"non-finite loss or gradient norm ({self.consecutive} in a row, --max_nonfinite_steps "
                  f"{self.max_consecutive}); their updates were skipped, the weights are finite. Resume from an "
                  "earlier checkpoint with a lower --learning_rate (or more --warmup_steps)")
        return self.loss_scaling


def _local_shard(param: torch.Tensor) -> torch.Tensor:
    """The part of a parameter this process holds: a ZeRO-3 partition, an FSDP2 DTensor's shard, or the tensor."""
    if hasattr(param, "ds_tensor"):
        return param.ds_tensor
    return param.to_local() if hasattr(param, "to_local") else param


def refuse_nonfinite_weights(accelerator: Accelerator, models: list[torch.nn.Module], what: str) -> None:
    """Stop the run (status DIVERGED_STATUS, one line) if any weight of `models` is NaN or inf on any rank.

    Collective (every rank checks its shards): call it on all ranks, before a checkpoint or an export.
    """
    bad = [name for model in models for name, p in model.named_parameters()
           if not torch.isfinite(_local_shard(p).detach()).all()]
    total = int(accelerator.reduce(torch.tensor(len(bad), device=accelerator.device), "sum").item())
    if total:
        example = f", e.g. {bad[0]}" if bad else ""
        _stop(accelerator, f"refusing to save {what}: {total} weight tensors hold NaN or inf{example}. The run "
              "diverged; resume from an earlier checkpoint with a lower --learning_rate")
