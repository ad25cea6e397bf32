"""The optimizer-step bookkeeping every training loop shares: where the run stands (`TrainingProgress`, saved in every
checkpoint), how many steps, and which micro-batches each one gets."""

from __future__ import annotations

import math
from collections.abc import Iterator

from accelerate import Accelerator, skip_first_batches
from torch.utils.data import DataLoader

from common.accumulation import accumulation_windows
from common.errors import fail


class TrainingProgress:
    """Optimizer steps done and the step log's window not yet logged (`log_window`: common/metrics.py StepLog's;
    `window`: the one a resume restored); registered with `accelerator.register_for_checkpointing` to travel with it."""

    def __init__(self) -> None:
        self.step, self.window, self.log_window = 0, None, None

    def state_dict(self) -> dict:
        return {"step": self.step, "window": self.log_window() if self.log_window else None}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.window = int(state["step"]), state.get("window")  # no window: a checkpoint of an older run


def track_progress(accelerator: Accelerator) -> TrainingProgress:
    """A step counter that every checkpoint saves and every resume restores (register once per Accelerator)."""
    progress = TrainingProgress()
    accelerator.register_for_checkpointing(progress)
    return progress


def count_optimizer_steps(dataloader: DataLoader, accumulation_steps: int, num_processes: int, max_steps: int,
                          num_train_epochs: float, unit: str = "examples") -> tuple[int | None, int]:
    """(optimizer steps per epoch, optimizer steps in all) for an unprepared dataloader (a stream: None, --max_steps).

    accelerate deals the batches out over the processes, evening out the last ones (or dropping them with
    `drop_last`); a trailing partial accumulation window is dropped.
    """
    if not hasattr(dataloader, "__len__"):  # a stream (common/features/streaming.py): --max_steps long
        return None, max_steps
    batches = len(dataloader)
    per_process = batches // num_processes if dataloader.drop_last else math.ceil(batches / num_processes)
    steps_per_epoch = per_process // accumulation_steps
    if steps_per_epoch == 0:
        fail(f"{len(dataloader.dataset)} training {unit} are fewer than one optimizer step needs "
             f"({dataloader.batch_size} x {accumulation_steps} accumulation x {num_processes} processes)")
    total_steps = max_steps if max_steps > 0 else math.ceil(num_train_epochs * steps_per_epoch)
    return steps_per_epoch, total_steps


def optimizer_step_windows(dataloader, progress: TrainingProgress, steps_per_epoch: int, total_steps: int,
                           accumulation_steps: int) -> Iterator[list[dict]]:
    """Yield the micro-batches of each optimizer step from `progress.step` (restored by a resume: the micro-batches
    it trained on are skipped) to exactly `total_steps` (also from a checkpoint at that step), across epochs.

    `progress.step` is advanced as each window is handed out: while the loop works on a window it holds the number of
    the step that window completes (the step to log and to checkpoint). `steps_per_epoch` None: an unsized loader
    that keeps its own place and cuts its own windows (common/features/streaming.py's `step_windows`).
    """
    if steps_per_epoch is None:
        yield from dataloader.step_windows(progress, total_steps, accumulation_steps)
        return
    while progress.step < total_steps:
        epoch, done = divmod(progress.step, steps_per_epoch)
        dataloader.set_epoch(epoch)  # the same shuffle per epoch, for any process count and after a resume
        batches = skip_first_batches(dataloader, done * accumulation_steps) if done else dataloader
        for window in accumulation_windows(batches, accumulation_steps):
            progress.step += 1
            yield window
            if progress.step >= total_steps:
                return
        if progress.step != (epoch + 1) * steps_per_epoch:  # else the next pass would resume at the same place
            raise RuntimeError(f"epoch {epoch} ended after optimizer step {progress.step}; "
                               f"{steps_per_epoch} steps per epoch were expected")
