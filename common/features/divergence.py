"""The divergence guard (--max_nonfinite_steps): a step whose loss or gradient norm is not finite is skipped on every
rank, too many in a row stop the run (DIVERGED_STATUS), and no non-finite weight is ever saved or exported.

A skipped step leaves the optimizer (moments, step count) and the learning-rate schedule untouched; the loop's
`zero_grad` drops its gradients. Two engines skip such steps themselves, before the loop can:
- fp16 loss scaling (a CUDA GradScaler): an overflow (finite loss, inf gradients) is normal while the scale settles.
  The verdict is then APPLY: the scaler skips the update and lowers its scale. The step is logged as skipped; only a
  non-finite loss counts towards divergence.
- DeepSpeed steps inside `accelerator.backward`. DeepSpeed 0.19.8's ZeRO-1/2/3 optimizers check the gradient norm
  (fp32, bf16 and fp16) and on inf/NaN skip the update and their own schedule, zero the gradients and report the
  norm as inf, which this guard then counts. A non-finite loss whose gradients are finite is applied there; the
  weight check before every save and export still refuses non-finite weights.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.optim.lr_scheduler import LambdaLR
from accelerate.logging import get_logger

from common.errors import fail, report_error
from common.guard import StepCheck, StepGuard, Verdict
from common.upstream import (prepared_models, prepared_optimizers_and_schedulers, set_last_lr,
                             take_back_step_count)

logger = get_logger(__name__)


def add_divergence_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("divergence guard").add_argument(
        "--max_nonfinite_steps", type=int, default=5,
        help="Stop (exit status 3) after this many steps in a row with a NaN/inf loss or gradient norm.")


def check_divergence_flags(args: argparse.Namespace) -> None:
    if args.max_nonfinite_steps < 1:
        fail(f"--max_nonfinite_steps must be >= 1 (got {args.max_nonfinite_steps})")


class NonFiniteGuard(StepGuard):
    """The step check of common/guard.py, judging each step: non-finite ones are skipped on every rank, and
    `max_consecutive` of them in a row stop the run.

    With fused Adam/AdamW (`--optim adamw_torch_fused`, the default) or Muon (common/features/muon.py, whose step
    honours `found_inf` too) the skip happens on the device, without a read:
    the optimizer's `found_inf` (the tensor torch's GradScaler sets) tells the fused kernel to leave the weights and
    moments untouched and to take its step count back. The host reads the step's figures a step later; a skipped
    step's schedule step is then taken back before the next update, so weights, moments and schedule are those of a
    step skipped on the host's word. Other optimizers (foreach AdamW, 8-bit, paged, Adafactor) and engines that skip
    on their own (DeepSpeed, fp16's GradScaler) have no device-side skip: their step waits for one read.
    """

    def __init__(self, accelerator: Accelerator, progress, max_consecutive: int) -> None:
        super().__init__(accelerator, progress)
        self.max_consecutive = max_consecutive
        self.loss_scaling = accelerator.mixed_precision == "fp16"
        self.consecutive = 0
        optimizers, schedulers = prepared_optimizers_and_schedulers(accelerator)
        self.optimizer, self.scheduler = optimizers[0] if optimizers else None, schedulers[0] if schedulers else None
        fused_adam = isinstance(self.optimizer, (torch.optim.Adam, torch.optim.AdamW)) and all(
            group.get("fused") for group in self.optimizer.param_groups)  # a resume restores the checkpoint's groups
        self.device_skip = (len(optimizers) == 1 and len(schedulers) == 1 and isinstance(self.scheduler, LambdaLR)
                            and (fused_adam or getattr(self.optimizer, "skips_on_found_inf", False))  # --optim muon
                            and accelerator.scaler is None
                            and accelerator.distributed_type != DistributedType.DEEPSPEED)

    def skips_on_device(self) -> bool:
        return self.device_skip

    def before_update(self, checked: StepCheck) -> None:
        loss, _, norm = checked.values
        # 1.0: the fused kernel skips the update (torch/optim/adam.py reads `found_inf` off the optimizer)
        self.optimizer.found_inf = (~(torch.isfinite(loss) & torch.isfinite(norm))).float()

    def verdict(self, checked: StepCheck) -> Verdict:
        verdict = self.judge(checked.step, checked.loss, checked.grad_norm)
        if verdict is not Verdict.APPLY and checked.ahead:  # the loop stepped the schedule: take that step back
            take_back_schedule_step(self.scheduler)
        return verdict

    def judge(self, step: int, loss: float, norm: float | None) -> Verdict:
        if math.isfinite(loss) and (norm is None or math.isfinite(norm)):
            self.consecutive = 0
            return Verdict.APPLY
        if self.loss_scaling and math.isfinite(loss):
            return Verdict.APPLY  # a gradient overflow while the loss scale settles: the scaler skips the update
        self.consecutive += 1
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


def take_back_schedule_step(scheduler: LambdaLR) -> None:
    """Undo one `scheduler.step()`: the schedule and each group's learning rate as before it (the same formula)."""
    scheduler.last_epoch -= 1
    take_back_step_count(scheduler)  # saved in its state_dict: a resume then equals the uninterrupted run
    lrs = [base * lmbda(scheduler.last_epoch) for lmbda, base in zip(scheduler.lr_lambdas, scheduler.base_lrs)]
    for group, lr in zip(scheduler.optimizer.param_groups, lrs):
        group["lr"] = lr
    set_last_lr(scheduler, lrs)


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


def finite_weights(accelerator: Accelerator, what: str) -> bool:
    """`CheckpointExtras.can_save`: the prepared models' trainable weights are all finite (collective)."""
    return weights_are_finite(accelerator, prepared_models(accelerator), what)


def export_if_finite(export: Callable) -> Callable:
    """`export(accelerator, model, tokenizer, output_dir)` that writes nothing and returns False (the reason printed)
    when a weight is not finite. Collective."""
    def checked_export(accelerator: Accelerator, model, tokenizer, output_dir: str) -> bool:
        return weights_are_finite(accelerator, [model], f"the model to {output_dir}") and \
            export(accelerator, model, tokenizer, output_dir)
    return checked_export
