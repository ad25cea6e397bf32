"""The run's lifecycle, in an order the code enforces: `RunLifecycle(...)` claims the output folder before any heavy
work; `start()`, after `accelerator.prepare`, restores a checkpoint and is the only source of the loop's step counter,
step log and step check (so they start at the restored step); `finish()` after the model's function has returned."""

from __future__ import annotations

import gc

from accelerate import Accelerator

from common.checkpoint import CheckpointExtras, resume
from common.guard import StepGuard
from common.metrics import StepLog
from common.output_dir import remove_leftovers, take_over_output_dir
from common.steps import TrainingProgress, track_progress


class RunLifecycle:
    """Claims --output_dir when created (leftovers of interrupted saves go); `start` takes it over and sets up the
    loop's objects."""

    def __init__(self, accelerator: Accelerator, output_dir: str, overwrite_output_dir: bool, resume_from: str | None,
                 extras: CheckpointExtras | None = None) -> None:
        self.accelerator, self.output_dir, self.resume_from = accelerator, output_dir, resume_from
        self.extras = extras or CheckpointExtras()
        self.started, self.overwrite_output_dir = False, overwrite_output_dir
        if accelerator.is_main_process:
            remove_leftovers(output_dir)
        accelerator.wait_for_everyone()

    def start(self, total_steps: int, steps_per_epoch: int | None, logging_steps: int,
              trackers: tuple[str, dict] | None = None, flops_per_token: float | None = None,
              progress: TrainingProgress | None = None) -> tuple[TrainingProgress, StepLog, StepGuard]:
        """After `accelerator.prepare`: restore the checkpoint, take the folder over, start the trackers; return the
        step counter (`progress`: one already registered, for a retry), step log and step check at the restored step."""
        if self.started:
            raise RuntimeError("RunLifecycle.start() runs once per run")
        self.started = True
        accelerator = self.accelerator
        progress = progress or track_progress(accelerator)
        resume(accelerator, self.resume_from, progress, self.extras)
        # every check that can stop the run has passed: only now may --overwrite_output_dir remove the previous run
        take_over_output_dir(accelerator, self.output_dir, self.overwrite_output_dir)
        if trackers:  # trackers reject None and lists
            project, config = trackers
            accelerator.init_trackers(project, config={k: v for k, v in config.items()
                                                       if isinstance(v, (int, float, str, bool))})
        log = StepLog(accelerator, self.output_dir, progress.step, total_steps, steps_per_epoch, logging_steps,
                      flops_per_token=flops_per_token, window=progress.window)
        progress.log_window = log.window_state  # the window not yet logged travels in every checkpoint
        return progress, log, StepGuard(accelerator, progress)


def finish(accelerator: Accelerator) -> None:
    """End trackers and the process group, after the function that held the prepared model has returned (also
    early): a DDP model still alive when the gloo group is destroyed makes the process abort at exit now and then."""
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
